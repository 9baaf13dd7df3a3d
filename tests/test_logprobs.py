"""Log-probabilities of emitted tokens: against a brute-force oracle (the prefill logits of each
position), and equal with speculation and without (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import prefill_logits, spec_prompts

from ngramspec import LLM, SamplingParams
from ngramspec.layers.sampler import apply_penalties, target_probs

TOL = 1e-4


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(num_threads=2, dtype="float32", speculative="ngram", verify_cost=[1.0] * 14)


def _oracle(engine, prompt: list[int], out: list[int], params: SamplingParams, i: int) -> torch.Tensor:
    """The log-distribution output token i was drawn from, recomputed by a prefill."""
    logits = prefill_logits(engine, prompt + out[:i])[-1].float()
    if params.logprobs_mode == "raw_logprobs":
        return torch.log_softmax(logits, -1)
    logits = apply_penalties(logits, params, prompt, out[:i])
    if params.greedy:
        return torch.log_softmax(logits, -1)
    return torch.log(target_probs(logits, params))


def _close(a: float, b: float) -> bool:
    return (a == b == -math.inf) or abs(a - b) <= TOL


def test_greedy_logprobs_with_speculation_equal_plain_and_the_oracle(llm, spec_llm):
    prompts = spec_prompts()[:6]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=5)
    plain = llm.generate([p for _, p, _ in prompts], params)
    spec = spec_llm.generate([p for _, p, _ in prompts], params)
    assert spec_llm.engine.stats.num_accepted_tokens > 0
    for (_, prompt, _), a, b in zip(prompts, spec, plain):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert x.token_id == a.token_ids[i] and _close(x.logprob, y.logprob)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(_close(p, q) for (_, p), (_, q) in zip(x.top, y.top))
            assert x.top[0][0] == x.token_id  # greedy: the chosen token is the most likely
        for i in (0, len(a.token_ids) // 2, len(a.token_ids) - 1):
            ref = _oracle(llm.engine, prompt, b.token_ids, params, i)
            assert _close(b.logprobs[i].logprob, float(ref[b.token_ids[i]]))
            values, ids = torch.topk(ref, 5)
            assert [t for t, _ in b.logprobs[i].top] == ids.tolist()


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_logprobs_are_of_the_distribution_asked_for(spec_llm, mode):
    prompt = spec_prompts()[0][1]
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, max_tokens=24,
                            seed=3, logprobs=3, logprobs_mode=mode)
    out = spec_llm.generate(prompt, params)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for i in range(len(out.token_ids)):
        ref = _oracle(spec_llm.engine, prompt, out.token_ids, params, i)
        assert _close(out.logprobs[i].logprob, float(ref[out.token_ids[i]]))
        assert all(_close(lp, float(ref[t])) for t, lp in out.logprobs[i].top)
    if mode == "processed_logprobs":  # top-k 20: everything else is ruled out
        assert all(len(e.top) == 3 and math.isfinite(e.logprob) for e in out.logprobs)


def test_no_logprobs_unless_asked(llm):
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))[0].logprobs is None
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="raw_logits")


def test_prompt_logprobs_equal_the_oracle_across_prefill_chunks(llm):
    """Raw logprobs of prompt tokens 1.., chunked prefill (64-token chunks) or not."""
    prompt = spec_prompts()[0][1][:150]
    ref = torch.log_softmax(prefill_logits(llm.engine, prompt).float(), -1)  # [n, V]
    chunked = LLM(num_threads=2, dtype="float32", max_num_batched_tokens=64)
    for engine_llm in (llm, chunked):
        out = engine_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                         prompt_logprobs=2, logprobs=0))[0]
        entries = out.prompt_logprobs
        assert [e.token_id for e in entries] == prompt[1:]
        for i, e in enumerate(entries):
            assert _close(e.logprob, float(ref[i, prompt[i + 1]]))
            assert [t for t, _ in e.top] == torch.topk(ref[i], 2).indices.tolist()
        assert len(out.logprobs) == len(out.token_ids)
