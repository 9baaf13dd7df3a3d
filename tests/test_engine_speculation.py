"""Speculation in the engine is lossless: greedy output equals plain decoding token for token, and
sampled output keeps the exact target distribution (tiny random model, chi-square)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    assert_no_kv_leak,
    check_divergence,
    first_difference,
    prefill_logits,
    repetitive_prompts,
    spec_prompts,
)

from ngramspec import LLM, SamplingParams
from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.tree import DraftTree
from ngramspec.layers.sampler import process_logits, target_probs
from ngramspec.sampling_params import resolve_for_model

FLAT_COST = [1.0] * 14  # verify cost independent of size: always draft the full tree


@pytest.fixture(scope="module")
def spec_llm(llm):
    return LLM(num_threads=2, dtype="float32", speculative="ngram", verify_cost=FLAT_COST)


@pytest.fixture(scope="module")
def plain_runs(llm):
    """Plain greedy outputs of every spec prompt, batched, by name. A greedy output cut at n tokens
    is the output asked for with max_tokens=n (rows are batch-invariant), so the tests that ask for
    fewer tokens compare against its first n."""
    prompts = spec_prompts()
    params = [SamplingParams(temperature=0, max_tokens=m) for _, _, m in prompts]
    outs = llm.generate([p for _, p, _ in prompts], params)
    return {name: out for (name, _, _), out in zip(prompts, outs)}


def test_greedy_spec_equals_plain_on_many_prompts(llm, spec_llm, plain_runs):
    prompts = spec_prompts()
    assert len(prompts) >= 20
    params = [SamplingParams(temperature=0, max_tokens=m) for _, _, m in prompts]
    plain = [plain_runs[name] for name, _, _ in prompts]
    spec = spec_llm.generate([p for _, p, _ in prompts], params)
    assert any(len(o.token_ids) >= 256 for o in plain), "needs long outputs"
    assert spec_llm.engine.stats.num_accepted_tokens > 0, "speculation never accepted anything"
    for (name, prompt, _), a, b in zip(prompts, spec, plain):
        check_divergence(llm, name, prompt, a.token_ids, b.token_ids)
        assert a.finish_reason == b.finish_reason or first_difference(a.token_ids, b.token_ids)


def test_greedy_spec_equals_plain_with_staggered_arrivals(llm, spec_llm, plain_runs):
    prompts = spec_prompts()[::3]
    params = SamplingParams(temperature=0, max_tokens=64)
    alone = [plain_runs[name].token_ids[:64] for name, _, _ in prompts]
    engine = spec_llm.engine
    seqs = []
    for _, prompt, _ in prompts:  # one new request every two steps, while others decode
        seqs.append(engine.add_request(f"stagger-{len(seqs)}", prompt, params))
        engine.step()
        engine.step()
    while engine.has_unfinished():
        engine.step()
    for (name, prompt, _), seq, ref in zip(prompts, seqs, alone):
        check_divergence(llm, name, prompt, seq.output_ids, ref)


def test_greedy_spec_equals_plain_with_threaded_drafting(llm, plain_runs, monkeypatch):
    """--draft-threads: the batch's trees built on two threads beside torch's own; output as
    plain decoding, and the threaded kernel really ran."""
    from ngramspec.drafting.kernels import native

    calls = []
    drafter_type = native().Drafter

    class Counted:  # the native Drafter, counting the batches it builds on threads
        def __init__(self) -> None:
            self.inner = drafter_type()

        def propose(self, *args):
            if args[-1]:  # parallel
                calls.append((len(args[0]) - args[1]) // 2)  # the batch: io after the queue
            return self.inner.propose(*args)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(native(), "Drafter", Counted)
    prompts = spec_prompts()[:12]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [plain_runs[name].token_ids[:48] for name, _, _ in prompts]
    spec = LLM(num_threads=2, dtype="float32", speculative="ngram", verify_cost=FLAT_COST,
               draft_threads=2).generate([p for _, p, _ in prompts], params)
    assert calls and max(calls) >= 8
    for (name, prompt, _), a, b in zip(prompts, spec, plain):
        check_divergence(llm, name, prompt, a.token_ids, b)


def test_learning_during_the_forward_changes_nothing(tiny_model_dirs, monkeypatch):
    """Speculator.overlap (the queued learning run while an asynchronous forward computes) gives
    the same trees, hence the same tokens and counters, as learning in the next propose."""
    from ngramspec.engine.model_runner import ModelRunner

    prompts = repetitive_prompts(6, 500, length=30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(model=str(tiny_model_dirs["llama"]), dtype="float32", speculative="ngram",
                   verify_cost=FLAT_COST)

    def run(llm: LLM) -> tuple[list[list[int]], tuple[int, int]]:
        first = llm.generate(prompts[:3], params)  # the rest start while others decode
        rest = llm.generate(prompts[3:], params)
        stats = llm.engine.stats
        return ([o.token_ids for o in first + rest],
                (stats.num_draft_tokens, stats.num_accepted_tokens))

    expected = run(LLM(**options))
    assert expected[1][1] > 0
    monkeypatch.setattr(ModelRunner, "asynchronous", property(lambda self: True))
    llm = LLM(**options)
    drafter = llm.engine.speculator.drafter
    flushed = []
    flush = drafter.flush

    def counting() -> None:
        flushed.append(len(drafter._queue))
        flush()

    monkeypatch.setattr(drafter, "flush", counting)
    assert run(llm) == expected
    assert sum(n > 0 for n in flushed) >= 2  # each wave's prompts were learned in a forward
    stats = llm.engine.stats
    assert stats.overlapped_draft_time > 0
    assert 0 < stats.device_time < stats.step_time  # forwards, timed inside the steps


def _amx() -> bool:
    from ngramspec.kernels import cpu_kernels, kernels_available

    return kernels_available() and cpu_kernels().amx_available()


@pytest.mark.parametrize("mode", [
    {"quantization": "gguf", "gguf_activations": "int8"},
    {"quantization": "gguf", "gguf_activations": "float32"},
    pytest.param({"dtype": "bfloat16"}, marks=pytest.mark.skipif(
        not _amx(), reason="bf16 linears are row-invariant only on AMX tiles (oneDNN elsewhere)")),
], ids=["gguf-int8", "gguf-float32", "bfloat16"])
@pytest.mark.model
def test_greedy_spec_equals_plain_in_faster_modes(mode):
    """The GGUF block kernels (int8 or float32 activations) and bf16 on AMX: speculative output
    equals the mode's own plain decoding (a third of the prompts, a code edit among them:
    the float32 test above runs them all)."""
    prompts = spec_prompts()[::3]
    plain_llm = LLM(num_threads=2, **mode)
    spec = LLM(num_threads=2, speculative="ngram", verify_cost=FLAT_COST, **mode)
    params = [SamplingParams(temperature=0, max_tokens=m) for _, _, m in prompts]
    plain = plain_llm.generate([p for _, p, _ in prompts], params)
    ours = spec.generate([p for _, p, _ in prompts], params)
    assert spec.engine.stats.num_accepted_tokens > 0
    for (name, prompt, _), a, b in zip(prompts, ours, plain):
        check_divergence(plain_llm, name, prompt, a.token_ids, b.token_ids)


@pytest.mark.model
def test_decoder_stack_is_bitwise_the_python_layers():
    """kernels/decoder_stack.cpp runs every layer in one call: prefill, decode and draft-tree
    rows give bitwise the logprobs of the Python layers."""
    llm = LLM(num_threads=2, quantization="gguf", speculative="ngram", verify_cost=FLAT_COST)
    model = llm.engine.runner.model
    stack = model.stack
    if stack is None and _amx():
        pytest.skip("the matrices run on AMX tiles here, which the stack does not call")
    assert stack is not None  # the bundled GGUF: one block type per fused matrix, no bias
    prompts = [p for _, p, _ in spec_prompts()[:3]]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3, prompt_logprobs=3)
    runs = []
    for layers in (stack, None):
        model.stack = layers
        llm.engine.speculator.drafter.reset()  # drafts from the prompts only, both times
        llm.engine.scheduler.flush_cache()  # every prompt prefilled by these layers
        outs = llm.generate(prompts, params)
        runs.append([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs])
    assert runs[0] == runs[1]
    assert llm.engine.stats.num_accepted_tokens > 0


def test_decoder_stack_only_where_it_covers_the_model(llm):
    """Dense float32 linears are not what the stack calls: the Python layers run them."""
    assert llm.engine.runner.model.stack is None


# ----------------------------------------------------------------------------- hand-built cases

class OracleDrafter:
    """Drafts the true continuation (known in advance) as a chain, plus a wrong sibling first."""

    def __init__(self, futures: dict[str, list[int]], depth: int = 6) -> None:
        self.futures, self.depth, self.done = futures, depth, {}

    def start(self, rid, prompt_ids, references=None):
        self.done[rid] = 0

    def propose(self, rids, budgets):
        trees = []
        for rid, budget in zip(rids, budgets):
            future = self.futures[rid][self.done[rid]:][: min(self.depth, budget - 1)]
            # Root token 0 is deliberately wrong (the engine must use the real last token), and
            # node 1 is a wrong first guess (token 1 is never output here).
            ids, parents = [0, 1], [-1, 0]
            for i, tok in enumerate(future):
                parents.append(0 if i == 0 else len(ids) - 1)
                ids.append(tok)
            trees.append(DraftTree(ids, parents, [1.0] * len(ids)))
        return trees

    def commit(self, rid, tokens):
        self.done[rid] += len(tokens)

    def stop(self, rid):
        self.done.pop(rid, None)

    def reset(self):
        self.done.clear()


def _with_oracle(prompts, futures_params):
    """Run `prompts` on an engine whose injected drafter knows each request's future."""
    futures = {f"oracle-{i}": future for i, (future, _) in enumerate(futures_params)}
    engine = LLM(num_threads=2, dtype="float32", speculative="ngram", draft_sizing="full",
                 custom_drafter=OracleDrafter(futures)).engine
    seqs = [engine.add_request(f"oracle-{i}", prompt, params)
            for i, (prompt, (_, params)) in enumerate(zip(prompts, futures_params))]
    while engine.has_unfinished():
        engine.step()
    assert_no_kv_leak(engine)
    return seqs


def test_stops_inside_an_accepted_run(llm, prompt_ids):
    """max_tokens, a stop token id, a stop string and EOS land inside long accepted runs."""
    base = SamplingParams(temperature=0, max_tokens=40)
    prompt = prompt_ids[0]  # ends with EOS after a short answer
    full = llm.generate(prompt, base)[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in llm.engine.eos_token_ids
    long_prompt = prompt_ids[6]
    long_full = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=60))[0].token_ids
    stop_tok = long_full[9]
    stop_text = llm.tokenizer.decode(long_full[14:17])
    cases = [
        (prompt, SamplingParams(temperature=0, max_tokens=40)),  # EOS mid-run
        (long_prompt, SamplingParams(temperature=0, max_tokens=11)),  # max_tokens mid-run
        (long_prompt, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_tok])),
        (long_prompt, SamplingParams(temperature=0, max_tokens=60, stop=[stop_text])),
    ]
    plain = [llm.generate(p, sp)[0] for p, sp in cases]
    future = [(full.token_ids + [5] * 20, cases[0][1])] + [(long_full, sp) for _, sp in cases[1:]]
    seqs = _with_oracle([p for p, _ in cases], future)
    for seq, ref in zip(seqs, plain):
        assert seq.output_ids == ref.token_ids
        assert seq.finish_reason == ref.finish_reason
        assert seq.spec.num_accepted_tokens > 0
        text = llm.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if seq.stop_text_len is not None:
            assert text[: seq.stop_text_len] == ref.text


def test_logit_processing_inside_an_accepted_run(llm, prompt_ids):
    """logit_bias and min_tokens apply at every tree node as plain decoding applies them at that
    position: drafts of the unprocessed continuation (EOS before min_tokens, a banned token) are
    rejected there, a stop token drafted right after min_tokens is accepted, and the output
    equals plain decoding's token for token."""
    short = llm.generate(prompt_ids[0], SamplingParams(temperature=0, max_tokens=40))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    n = len(short.token_ids)
    long_prompt = prompt_ids[6]
    long_full = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=40))[0].token_ids
    # positions whose token is new: as a stop token with min_tokens = k it ends the output there
    fresh = [k for k in range(4, 30) if long_full[k] not in long_full[:k]][:2]
    assert len(fresh) == 2, long_full
    cases = [  # (prompt, params, the drafted future: what the request would do unprocessed)
        (prompt_ids[0], SamplingParams(temperature=0, max_tokens=n + 12, min_tokens=n + 6),
         short.token_ids + [5] * 20),
        (prompt_ids[0], SamplingParams(temperature=0, max_tokens=40, min_tokens=n - 1),
         short.token_ids),
        (long_prompt, SamplingParams(temperature=0, max_tokens=30,
                                     logit_bias={long_full[12]: -100.0, long_full[20]: 4.0}),
         long_full),
        *[(long_prompt, SamplingParams(temperature=0, max_tokens=40, min_tokens=k,
                                       stop_token_ids=[long_full[k]]), long_full) for k in fresh],
        (long_prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=25,
                                     stop_token_ids=[long_full[8]], repetition_penalty=1.2,
                                     logit_bias={long_full[3]: 1.5}),
         long_full),
    ]
    plain = [llm.generate(p, sp)[0] for p, sp, _ in cases]
    assert len(plain[0].token_ids) > n and plain[0].token_ids[: n - 1] == short.token_ids[:-1]
    assert plain[1].token_ids == short.token_ids
    assert plain[2].token_ids != long_full[:30]  # the bias changed the output
    for k, out in zip(fresh, plain[3:5]):
        assert out.token_ids == long_full[: k + 1] and out.finish_reason == "stop"
    seqs = _with_oracle([p for p, _, _ in cases], [(f, sp) for _, sp, f in cases])
    for seq, ref in zip(seqs, plain):
        assert seq.output_ids == ref.token_ids
        assert seq.finish_reason == ref.finish_reason
        assert seq.spec.num_accepted_tokens > 0


# ----------------------------------------------------------------------------- sampling

class RandomTreeDrafter:
    """Random trees over a small candidate set: often wrong, sometimes right, duplicates never."""

    def __init__(self, candidates: list[int], seed: int = 0) -> None:
        self.candidates, self.rng, self.last = candidates, random.Random(seed), {}

    def start(self, rid, prompt_ids, references=None):
        self.last[rid] = prompt_ids[-1]

    def propose(self, rids, budgets):
        trees = []
        for rid, budget in zip(rids, budgets):
            ids, parents = [self.last[rid]], [-1]
            for _ in range(self.rng.randint(0, min(budget, 8))):
                parent = self.rng.randrange(len(ids))
                taken = {ids[i] for i in range(1, len(ids)) if parents[i] == parent}
                free = [c for c in self.candidates if c not in taken]
                if free:
                    ids.append(self.rng.choice(free))
                    parents.append(parent)
            trees.append(DraftTree(ids, parents))
        return trees

    def commit(self, rid, tokens):
        self.last[rid] = tokens[-1]

    def stop(self, rid):
        self.last.pop(rid, None)

    def reset(self):
        self.last.clear()


def _exact_joint(engine, prompt, params, length=3) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first `length` tokens under plain sampling."""
    params = resolve_for_model(params, engine.eos_token_ids, engine.tokenizer.encode)
    probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, p in probs.items():
            logits = prefill_logits(engine, prompt + list(prefix))[-1]
            logits = process_logits(logits, params, prompt, list(prefix))
            q = target_probs(logits, params)
            for tok in q.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = p * float(q[tok])
        probs = nxt
    return probs


def _chi_square_p(counts: dict, expected: dict[tuple, float], n: int) -> float:
    cells, other_obs, other_exp, stat = 0, 0, 0.0, 0.0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            other_obs += counts.get(key, 0)
            other_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    assert sum(v for k, v in counts.items() if k not in expected) == 0, "sampled an impossible token"
    if other_exp > 0:
        stat += (other_obs - other_exp) ** 2 / other_exp
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _tiny_llm(tiny_model_dirs, model=None, **options) -> LLM:
    return LLM(model=str(model or tiny_model_dirs["llama"]), num_threads=2, max_num_seqs=256,
               max_num_batched_tokens=4096, **options)


def _sample(llm, prompt, params, n, seed0):
    outs = llm.generate([prompt] * n, [SamplingParams(**{**_fields(params), "seed": seed0 + i})
                                       for i in range(n)])
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__slots__}


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "gguf"])
def test_sampling_with_speculation_keeps_the_target_distribution(tiny_model_dirs, tiny_gguf, mode):
    """In each weight mode (gguf: a tiny random GGUF of Q4_0/Q4_1/Q8_0 blocks)."""
    options = {"model": tiny_gguf, "quantization": "gguf"} if mode == "gguf" else {"dtype": mode}
    prompt = [5, 17, 42, 99, 7, 3]
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, presence_penalty=0.7,
                            max_tokens=3, ignore_eos=True)
    exact = _exact_joint(_tiny_llm(tiny_model_dirs, **options).engine, prompt, params)
    support = sorted({t for key in exact for t in key})
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram", draft_sizing="full",
                    custom_drafter=RandomTreeDrafter(support + [0, 1]), **options)
    engine = llm.engine
    n = 2400
    spec_counts = _sample(llm, prompt, params, n, seed0=10_000)
    assert engine.stats.num_accepted_tokens > 50, "forced drafts were never accepted"
    assert engine.stats.num_draft_tokens > 2 * engine.stats.num_accepted_tokens, "drafts too easy"
    p_spec = _chi_square_p(spec_counts, exact, n)
    plain = SamplingParams(**{**_fields(params), "speculative": False})
    p_plain = _chi_square_p(_sample(llm, prompt, plain, n, seed0=50_000), exact, n)
    print(f"chi-square p: speculative {p_spec:.3g}, plain {p_plain:.3g} ({len(exact)} outcomes)")
    assert p_spec > 1e-3
    assert p_plain > 1e-3
    # The test can fail: the same samples against a wrong (colder) distribution are rejected.
    wrong = _exact_joint(engine, prompt, SamplingParams(**{**_fields(params), "temperature": 0.4}))
    assert _chi_square_p(spec_counts, wrong, n) < 1e-3


def test_sampling_with_logit_processing_keeps_the_target_distribution(tiny_model_dirs):
    """logit_bias, a stop token held back by min_tokens, and a penalty: speculative samples keep
    the processed distribution while drafts keep proposing the masked and penalised tokens."""
    prompt = [5, 17, 42, 99, 7, 3]
    base = _tiny_llm(tiny_model_dirs, dtype="float32").engine
    ranked = prefill_logits(base, prompt)[-1].argsort(descending=True).tolist()
    params = SamplingParams(temperature=0.9, top_k=8, max_tokens=3, min_tokens=2,
                            stop_token_ids=[ranked[0]], frequency_penalty=0.8,
                            logit_bias={ranked[1]: -100.0, ranked[5]: 2.5, ranked[30]: 5.0})
    exact = _exact_joint(base, prompt, params)
    assert all(ranked[0] not in key[:2] and ranked[1] not in key for key in exact)
    support = sorted({t for key in exact for t in key})
    llm = _tiny_llm(tiny_model_dirs, dtype="float32", speculative="ngram", draft_sizing="full",
                    custom_drafter=RandomTreeDrafter(support + ranked[:2]))
    n = 2400
    spec_counts = _sample(llm, prompt, params, n, seed0=20_000)
    assert llm.engine.stats.num_accepted_tokens > 50, "forced drafts were never accepted"
    p_spec = _chi_square_p(spec_counts, exact, n)
    print(f"chi-square p: speculative {p_spec:.3g} ({len(exact)} outcomes)")
    assert p_spec > 1e-3
    # The test can fail: the same samples against a distribution without one bias are rejected.
    bias = {**params.logit_bias, ranked[5]: 0.0}
    wrong = _exact_joint(base, prompt, SamplingParams(**{**_fields(params), "logit_bias": bias}))
    assert _chi_square_p({k: v for k, v in spec_counts.items() if k in wrong}, wrong, n) < 1e-3


# ----------------------------------------------------------------------------- KV integrity

def test_thousand_mixed_requests_leave_no_slot_behind(tiny_model_dirs):
    small = dict(model=str(tiny_model_dirs["llama"]), num_threads=2, max_num_seqs=48,
                 kv_cache_bytes=2400 * 2 * 2 * 2 * 32 * 4)  # ~2400 slots: requests must wait
    spec = LLM(speculative="ngram", verify_cost=FLAT_COST, **small)
    plain = LLM(**small)
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(40)]
    prompts, params = [], []
    for i in range(1000):
        start = rng.randrange(20)
        prompts.append(base[start : start + rng.randrange(4, 20)] + base[:rng.randrange(1, 8)])
        kind = i % 3
        params.append(SamplingParams(temperature=0 if kind else 0.8, seed=i, ignore_eos=True,
                                     max_tokens=rng.randrange(1, 24), speculative=kind != 2))
    outs = spec.generate(prompts, params)
    refs = plain.generate(prompts, params)
    assert_no_kv_leak(spec.engine)
    assert spec.engine.stats.num_accepted_tokens > 0
    for o, r, p in zip(outs, refs, params):
        assert len(o.token_ids) == p.max_tokens
        if p.temperature == 0:
            assert o.token_ids == r.token_ids


def test_llm_takes_a_drafter_config_and_a_custom_drafter_apart(tiny_model_dirs):
    """`drafter=` stays the DrafterConfig option; an injected drafter needs speculation on."""
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram", drafter=DrafterConfig(max_trie_depth=7))
    assert llm.engine.speculator.drafter.config.max_trie_depth == 7
    with pytest.raises(ValueError, match="speculation is off"):
        _tiny_llm(tiny_model_dirs, custom_drafter=RandomTreeDrafter([1, 2]))


class _FailingDrafter(RandomTreeDrafter):
    """Raises in every third propose: a drafter bug must cost speed, never a request."""

    def __init__(self, candidates: list[int]) -> None:
        super().__init__(candidates)
        self.calls = 0

    def propose(self, rids, budgets):
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError("drafter bug")
        return super().propose(rids, budgets)


def test_a_failing_drafter_costs_drafts_not_requests(tiny_model_dirs, caplog):
    prompts = repetitive_prompts(4, 500, length=20, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = _tiny_llm(tiny_model_dirs).generate(prompts, params)
    drafter = _FailingDrafter(sorted({t for p in prompts for t in p}))
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram", verify_cost=FLAT_COST,
                    custom_drafter=drafter)
    with caplog.at_level("WARNING", logger="ngramspec.engine.engine"):
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.engine.stats
    assert stats.draft_failures == drafter.calls // 3 > 0
    assert stats.num_draft_tokens > 0  # the other steps still drafted
    assert sum("the drafter failed" in r.getMessage() for r in caplog.records) == 1
    assert_no_kv_leak(llm.engine)
