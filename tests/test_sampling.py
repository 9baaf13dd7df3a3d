"""Sampling: parameter validation, logit processing against brute-force references, seeds, stops."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import GreedyRef, assert_same_tokens
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ngramspec import SamplingParams
from ngramspec.layers.sampler import (
    apply_penalties,
    argmax_rows,
    process_logits,
    sample_token,
    target_probs,
)
from ngramspec.sampling_params import resolve_for_model

# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": -0.2}, "top_p"),
    ({"top_p": 1.01}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"), ({"seed": 1.0}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_each_bad_parameter_names_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_boundary_parameters_are_accepted() -> None:
    p = SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=1.0, max_tokens=1,
                       presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5, stop="x")
    assert p.greedy and p.has_penalties and p.stop == ["x"]
    assert not SamplingParams().has_penalties and not SamplingParams().greedy
    assert not SamplingParams().processes_logits
    q = SamplingParams(logit_bias={"7": -100, 3: 2.5}, min_tokens=4, max_tokens=4)
    assert q.logit_bias == {7: -100, 3: 2.5}  # JSON's string keys become token ids, as vLLM
    assert q.processes_logits and not q.has_penalties
    for kwargs in ({"min_tokens": 1}, {"allowed_token_ids": [1]}, {"logit_bias": {1: 0.5}}):
        assert SamplingParams(**kwargs).processes_logits, kwargs


# ----------------------------------------------------------------------------- brute force


def ref_penalties(logits: list[float], p: SamplingParams, prompt: list[int],
                  out: list[int]) -> list[float]:
    """vLLM: repetition divides positive / multiplies negative logits of every token seen in prompt
    or output; frequency subtracts count * f and presence subtracts p for output tokens."""
    res = list(logits)
    for t in set(prompt + out):
        if p.repetition_penalty != 1:
            res[t] = res[t] / p.repetition_penalty if res[t] > 0 else res[t] * p.repetition_penalty
    for t in set(out):
        res[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return res


def ref_process(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int],
                eos: list[int]) -> list[float]:
    """vLLM's order: allowed_token_ids keeps only those; a bad word's last token is banned when
    the output ends with its other tokens; min_tokens bans EOS and stop_token_ids while the
    output is shorter; logit_bias is added; then the penalties."""
    res = list(logits)
    if p.allowed_token_ids is not None:
        res = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(res)]
    for word in p.bad_words_token_ids:
        if len(out) >= len(word) - 1 and out[len(out) - len(word) + 1:] == list(word[:-1]):
            res[word[-1]] = -math.inf
    if len(out) < p.min_tokens:
        for t in p.stop_token_ids + eos:
            res[t] = -math.inf
    for t, bias in (p.logit_bias or {}).items():
        res[t] += bias
    return ref_penalties(res, p, prompt, out)


def ref_probs(logits: list[float], p: SamplingParams) -> list[float]:
    z = [x / p.temperature for x in logits]
    if 0 < p.top_k < len(z):
        kth = sorted(z, reverse=True)[p.top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    probs = [x / sum(e) for x in e]
    if p.top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [x if i in kept else 0.0 for i, x in enumerate(probs)]
    if p.min_p > 0:
        top = max(probs)
        probs = [x if x >= p.min_p * top else 0.0 for x in probs]
    return [x / sum(probs) for x in probs]


def _margins_ok(logits: list[float], p: SamplingParams) -> bool:
    """False when top-p or min-p sit within float32 rounding of a cut (either answer is right)."""
    probs = sorted(ref_probs(logits, SamplingParams(temperature=p.temperature, top_k=p.top_k)),
                   reverse=True)
    cums = [sum(probs[: i + 1]) for i in range(len(probs))]
    near_top_p = p.top_p < 1 and any(abs(c - p.top_p) < 1e-4 for c in cums)
    near_min_p = p.min_p > 0 and any(abs(x - p.min_p * probs[0]) <= 1e-5 for x in probs)
    return not near_top_p and not near_min_p


vocab_logits = st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=24, unique=True)


@settings(max_examples=150, deadline=None)
@given(logits=vocab_logits, data=st.data(),
       rep=st.sampled_from([1.0, 0.7, 1.3, 2.0]), pres=st.floats(-2, 2), freq=st.floats(-2, 2))
def test_penalties_match_brute_force(logits, data, rep, pres, freq) -> None:
    v = len(logits)
    prompt = data.draw(st.lists(st.integers(0, v - 1), max_size=8))
    out = data.draw(st.lists(st.integers(0, v - 1), max_size=8))
    p = SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    got = apply_penalties(torch.tensor(logits), p, prompt, out)
    want = torch.tensor(ref_penalties(logits, p, prompt, out))
    assert torch.allclose(got, want, atol=1e-4), (got, want)


@settings(max_examples=200, deadline=None)
@given(logits=vocab_logits, data=st.data(), rep=st.sampled_from([1.0, 1.3]),
       pres=st.sampled_from([0.0, 0.5]))
def test_logit_processing_matches_brute_force(logits, data, rep, pres) -> None:
    """logit_bias, min_tokens, allowed_token_ids and bad_words (token ids as the engine resolves
    them), with penalties, against the reference at every output length."""
    v = len(logits)
    token = st.integers(0, v - 1)
    prompt = data.draw(st.lists(token, max_size=6))
    out = data.draw(st.lists(token, max_size=8))
    eos = data.draw(st.lists(token, max_size=2))
    p = SamplingParams(
        max_tokens=16, repetition_penalty=rep, presence_penalty=pres,
        min_tokens=data.draw(st.integers(0, 10)),
        stop_token_ids=data.draw(st.lists(token, max_size=2)),
        logit_bias=data.draw(st.one_of(st.none(), st.dictionaries(
            token, st.floats(-100, 100, width=32), max_size=4))),
        allowed_token_ids=data.draw(st.one_of(st.none(), st.lists(token, min_size=1,
                                                                     max_size=v))))
    words = data.draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=3))
    p = dataclasses.replace(p, _eos_token_ids=tuple(eos),
                            _bad_words_token_ids=tuple(tuple(w) for w in words))
    for n in range(len(out) + 1):
        got = process_logits(torch.tensor(logits), p, prompt, out[:n])
        want = torch.tensor(ref_process(logits, p, prompt, out[:n], eos))
        assert torch.allclose(got, want, atol=1e-3), (n, got, want)


def test_bad_words_are_tokenised_as_vllm_does() -> None:
    """Each word as it starts a text, and after a space where that is another token sequence of
    the same length (a word inside a text)."""
    table = {"ab": [1, 2], " ab": [7, 2], "cd": [3, 4], " cd": [9], "e": [5], " e": [5]}
    p = resolve_for_model(SamplingParams(bad_words=["ab", " cd", "e"]), [0], table.__getitem__)
    assert p.bad_words_token_ids == ((1, 2), (7, 2), (3, 4), (5,))
    assert p.all_stop_token_ids == (0,)
    assert SamplingParams(bad_words=["ab"]).bad_words_token_ids == ()  # until the engine resolves


def test_greedy_follows_bias_and_min_tokens() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    eos = dataclasses.replace(SamplingParams(temperature=0, min_tokens=2, max_tokens=4),
                              _eos_token_ids=(0,))
    assert sample_token(logits, eos, [], [5], None) == 1  # EOS masked: 1 output token < 2
    assert sample_token(logits, eos, [], [5, 5], None) == 0
    bias = SamplingParams(temperature=0, logit_bias={3: 3.5})
    assert sample_token(logits, bias, [], [], None) == 3
    allowed = SamplingParams(temperature=0, allowed_token_ids=[2, 3])
    assert sample_token(logits, allowed, [], [], None) == 2


def test_samples_follow_the_biased_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = dataclasses.replace(SamplingParams(temperature=0.9, top_p=0.97, min_tokens=3,
                                           stop_token_ids=[1], max_tokens=8,
                                           logit_bias={7: 4.0, 2: -1.5}),
                            _eos_token_ids=(0,))
    prompt, out = [3], [4, 4]
    probs = target_probs(torch.tensor(ref_process(logits.tolist(), p, prompt, out, [0])), p)
    assert probs[0] == 0 and probs[1] == 0 and probs[7] > 0.3
    _assert_samples_follow(logits, p, prompt, out, probs)


@settings(max_examples=200, deadline=None)
@given(logits=vocab_logits, temperature=st.floats(0.1, 3), top_k=st.integers(-1, 30),
       top_p=st.floats(0.05, 1.0), min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_processed_distribution_matches_brute_force(logits, temperature, top_k, top_p,
                                                    min_p) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assume(_margins_ok(logits, p))
    got = target_probs(torch.tensor(logits, dtype=torch.float64), p)
    want = torch.tensor(ref_probs(logits, p), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    assert ((got > 0) == (want > 0)).all()


def test_samples_follow_the_processed_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.2,
                       presence_penalty=0.3)
    prompt, out = [0, 3], [1, 1]
    probs = target_probs(apply_penalties(logits, p, prompt, out), p)
    _assert_samples_follow(logits, p, prompt, out, probs)


row_values = st.one_of(st.floats(-4, 4, width=32), st.sampled_from(
    [0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan")]))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6).flatmap(
    lambda v: st.lists(st.lists(row_values, min_size=v, max_size=v), min_size=1, max_size=5)))
def test_argmax_rows_equals_a_first_maximum_scan(rows) -> None:
    """Ties go to the first maximum and a NaN counts as the maximum (torch's rule), on the numpy
    path the CPU takes, on a strided view and on the torch path the other dtypes take."""
    def first_max(row: list[float]) -> int:
        nans = [i for i, x in enumerate(row) if math.isnan(x)]
        return nans[0] if nans else row.index(max(row))

    expected = [first_max(r) for r in rows]
    logits = torch.tensor(rows, dtype=torch.float32)
    assert argmax_rows(logits) == expected
    assert argmax_rows(logits.t().contiguous().t()) == expected  # column-major strides
    assert argmax_rows(logits.double()) == expected
    with torch.inference_mode():  # as the engine's logits come
        assert argmax_rows(logits.clone()) == expected


def test_greedy_sample_is_penalised_argmax() -> None:
    logits = torch.tensor([3.0, 2.9, -1.0, 0.5])
    assert sample_token(logits, SamplingParams(temperature=0), [], [], None) == 0
    p = SamplingParams(temperature=0, repetition_penalty=1.1)
    assert sample_token(logits, p, [0], [], None) == 1  # 3.0 / 1.1 < 2.9


# ----------------------------------------------------------------------------- through the engine

SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1234,
                         max_tokens=8, ignore_eos=True, repetition_penalty=1.1,
                         presence_penalty=0.2, frequency_penalty=0.1)


def test_seeded_sampling_is_reproducible_and_exact(llm, prompt_ids, probe) -> None:
    rec = probe(llm.engine)
    first = llm.generate(prompt_ids[1], SAMPLED)[0]
    # Replay plain decoding by hand from the recorded raw logits: same generator, same draws.
    gen = torch.Generator().manual_seed(SAMPLED.seed)
    prompt, out = prompt_ids[1], []
    for row in rec.rows[first.request_id]:
        out.append(sample_token(row, SAMPLED, prompt, out, gen))
    assert out == first.token_ids
    again = llm.generate(prompt_ids[1], SAMPLED)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)]
    batched = llm.generate([prompt_ids[0], prompt_ids[1], prompt_ids[3]],
                           [others[0], SAMPLED, others[1]])
    assert again.token_ids == first.token_ids
    assert batched[1].token_ids == first.token_ids
    other_seed = SamplingParams(**{**_fields(SAMPLED), "seed": 4321})
    assert llm.generate(prompt_ids[1], other_seed)[0].token_ids != first.token_ids


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__slots__}


def test_top_k_1_equals_greedy(llm, prompt_ids, greedy_alone) -> None:
    params = SamplingParams(temperature=1.3, top_k=1, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt_ids[0], prompt_ids[3]], params)
    for out, ref in zip(outs, (greedy_alone[0], greedy_alone[3])):
        assert_same_tokens(out.token_ids, GreedyRef(ref.tokens[:8], ref.gaps[:8]), "top_k=1")


def test_penalised_greedy_follows_processed_logits(llm, probe) -> None:
    prompt = llm.encode("red blue red blue red blue red blue red blue red blue")
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5,
                       presence_penalty=0.5, frequency_penalty=0.5)
    rec = probe(llm.engine)
    out = llm.generate(prompt, p)[0]
    rows = rec.rows[out.request_id]
    changed = 0
    for t, (row, token) in enumerate(zip(rows, out.token_ids)):
        processed = ref_penalties(row.tolist(), p, prompt, out.token_ids[:t])
        assert token == max(range(len(processed)), key=processed.__getitem__), f"step {t}"
        changed += token != int(row.argmax())
    assert changed > 0, "the penalties never changed a choice: the test proves nothing"


# ----------------------------------------------------------------------------- stops


def test_stop_token_ids(llm, prompt_ids, greedy_alone) -> None:
    ref = greedy_alone[3].tokens
    stop = ref[5]
    j = ref.index(stop)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    out = llm.generate(prompt_ids[3], p)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: j + 1]


def test_stop_strings_truncate_text(llm, prompt_ids, greedy_alone) -> None:
    ref = greedy_alone[1].tokens
    full = llm.tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[12:17]
    assert stop.strip(), f"pick another slice of {full!r}"
    later = full[30:36] if len(full) > 40 else "\x00never"
    # The earliest match wins whichever order the stop strings are given in.
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[later, stop])
    out = llm.generate(prompt_ids[1], p)[0]
    n = next(k for k in range(1, len(ref) + 1)
             if stop in llm.tokenizer.decode(ref[:k], skip_special_tokens=True))
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert out.token_ids == ref[:n]


def test_eos_stops_unless_ignore_eos(llm) -> None:
    prompt = llm.apply_chat_template([{"role": "user", "content": "Say only the word: yes"}])
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    assert stopped.finish_reason == "stop", "the model did not end with EOS: pick another prompt"
    eos = stopped.token_ids[-1]
    assert eos in llm.engine.eos_token_ids and len(stopped.token_ids) < 16
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(stopped.token_ids) + 3,
                                               ignore_eos=True))[0]
    assert kept.finish_reason == "length" and len(kept.token_ids) == len(stopped.token_ids) + 3
    assert kept.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    assert llm.tokenizer.decode([eos]) not in stopped.text  # special tokens stay out of the text


# ----------------------------------------------------------------------------- vLLM's fields


def test_min_tokens_masks_eos_until_reached(llm, probe) -> None:
    prompt = llm.apply_chat_template([{"role": "user", "content": "Say only the word: yes"}])
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 8
    eos = llm.engine.eos_token_ids
    p = SamplingParams(temperature=0, max_tokens=24, min_tokens=len(stopped.token_ids) + 4)
    rec = probe(llm.engine)
    out = llm.generate(prompt, p)[0]
    assert len(out.token_ids) > p.min_tokens or out.finish_reason == "length"
    assert not set(out.token_ids[: p.min_tokens]) & set(eos)
    for t, (row, token) in enumerate(zip(rec.rows[out.request_id], out.token_ids)):
        processed = ref_process(row.tolist(), p, prompt, out.token_ids[:t], list(eos))
        assert token == max(range(len(processed)), key=processed.__getitem__), f"step {t}"


def test_logit_bias_allowed_and_bad_words_steer_greedy(llm, prompt_ids, greedy_alone) -> None:
    ref = greedy_alone[3].tokens
    favoured = ref[2]
    out = llm.generate(prompt_ids[3], SamplingParams(temperature=0, max_tokens=4,
                                                     logit_bias={favoured: 100}))[0]
    assert out.token_ids == [favoured] * 4
    banned = llm.generate(prompt_ids[3], SamplingParams(temperature=0, max_tokens=4,
                                                        logit_bias={ref[0]: -100}))[0]
    assert banned.token_ids[0] != ref[0]
    allowed = sorted(set(ref[3:6]))
    only = llm.generate(prompt_ids[3], SamplingParams(temperature=0, max_tokens=6,
                                                      allowed_token_ids=allowed))[0]
    assert set(only.token_ids) <= set(allowed)
    word = llm.tokenizer.decode(ref[:2]).strip()
    assert word, f"pick another word than {ref[:2]}"
    p = SamplingParams(temperature=0, max_tokens=len(ref), ignore_eos=True, bad_words=[word])
    free = llm.generate(prompt_ids[3], p)[0]
    ids = resolve_for_model(p, [], llm.encode).bad_words_token_ids
    assert ids and free.token_ids != ref[: len(free.token_ids)]
    for seq in ids:
        assert not any(free.token_ids[i:i + len(seq)] == list(seq)
                       for i in range(len(free.token_ids))), (word, seq)


def test_include_stop_str_and_special_tokens_in_text(llm, prompt_ids, greedy_alone) -> None:
    ref = greedy_alone[1].tokens
    full = llm.tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[12:17]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=True)
    out = llm.generate(prompt_ids[1], p)[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop) + len(stop)]
    prompt = llm.apply_chat_template([{"role": "user", "content": "Say only the word: yes"}])
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                               skip_special_tokens=False))[0]
    assert kept.finish_reason == "stop"
    assert kept.text.endswith(llm.tokenizer.decode([kept.token_ids[-1]]))


def _assert_samples_follow(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                           out: list[int], probs: torch.Tensor, n: int = 4000) -> None:
    """`n` seeded samples of sample_token match `probs` within 4 sigma; zeros never drawn."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample_token(logits, p, prompt, out, gen)
                                          for _ in range(n)]), minlength=len(logits))
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4 * sigma + 1e-9).all(), (counts / n, probs)
    assert counts[probs == 0].sum() == 0


@pytest.mark.parametrize("top_p", [7.19364158662655e-72, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """top_p below float32's range compares as 0 against float32 probabilities; the nucleus
    still holds its first token, so sampling is greedy instead of failing."""
    from ngramspec.layers.sampler import sample_token, target_probs

    logits = torch.tensor([0.5, 3.0, 1.0, 3.0 - 1e-3])
    p = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=1)
    probs = target_probs(logits, p)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample_token(logits, p, [], [], torch.Generator().manual_seed(0)) == 1
