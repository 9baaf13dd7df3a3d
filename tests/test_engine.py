"""Engine behaviour: batch invariance, staggered arrival, chunked prefill, clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY, NUM_THREADS, assert_no_kv_leak, assert_same_tokens, prefill_logits

from ngramspec import LLM, SamplingParams


@pytest.fixture(scope="module")
def chunked_llm():
    """Prefill runs in chunks of at most 16 tokens per step."""
    return LLM(num_threads=NUM_THREADS, dtype="float32", max_num_batched_tokens=16)


def _drain(engine, outputs: dict[str, list[int]]) -> None:
    for out in engine.step():
        outputs.setdefault(out.seq.request_id, []).extend(out.new_token_ids)


def test_batched_greedy_equals_alone(llm, prompt_ids, greedy_alone) -> None:
    outs = llm.generate(prompt_ids, GREEDY)
    for i, (out, ref) in enumerate(zip(outs, greedy_alone)):
        assert_same_tokens(out.token_ids, ref, f"prompt {i} batched with {len(outs) - 1} others")


def test_staggered_arrival_equals_alone(llm, prompt_ids, greedy_alone) -> None:
    # A new request joins every other step, so prefills mix with decodes of every age.
    engine, outputs, ids = llm.engine, {}, []
    for i, prompt in enumerate(prompt_ids):
        ids.append(llm.add_request(prompt, GREEDY))
        for _ in range(1 + i % 2):
            _drain(engine, outputs)
    while engine.has_unfinished():
        _drain(engine, outputs)
    for i, (rid, ref) in enumerate(zip(ids, greedy_alone)):
        assert_same_tokens(outputs[rid], ref, f"prompt {i} with staggered arrivals")


def test_chunked_prefill_same_logits_and_tokens(chunked_llm, llm, prompt_ids, greedy_alone,
                                                 probe) -> None:
    rec = probe(chunked_llm.engine)
    for i in (6, 2):  # the ~300-token prompt (19 chunks) and a short one
        steps = chunked_llm.engine.stats.num_steps
        out = chunked_llm.generate(prompt_ids[i], GREEDY)[0]
        prefill_steps = -(-len(prompt_ids[i]) // 16)
        assert chunked_llm.engine.stats.num_steps - steps == prefill_steps + GREEDY.max_tokens - 1
        first = rec.rows[out.request_id][0]
        ref = prefill_logits(llm.engine, prompt_ids[i])[-1]
        assert (first - ref).abs().max() <= 1e-3, f"prompt {i}: first-token logits differ"
        assert_same_tokens(out.token_ids, greedy_alone[i], f"prompt {i} chunked prefill")


def test_max_tokens_and_lengths(llm, prompt_ids, greedy_alone) -> None:
    outs = llm.generate(prompt_ids[:3], [SamplingParams(temperature=0, max_tokens=n,
                                                        ignore_eos=True) for n in (1, 3, 5)])
    for i, (n, out) in enumerate(zip((1, 3, 5), outs)):
        assert out.finish_reason == "length" and len(out.token_ids) == n
        assert out.token_ids == greedy_alone[i].tokens[:n]
        assert out.prompt_token_ids == prompt_ids[i]
        assert out.metrics is not None and out.metrics.e2e >= out.metrics.ttft >= 0


# ----------------------------------------------------------------------------- errors


def _still_serves(llm, prompt_ids, greedy_alone) -> None:
    assert not llm.engine.has_unfinished(), "a rejected request was left in the engine"
    out = llm.generate(prompt_ids[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert out[0].token_ids == greedy_alone[1].tokens[:2]
    assert_no_kv_leak(llm.engine)


@pytest.mark.parametrize("make_call, match", [
    (lambda llm, ids: llm.generate(""), "the prompt is empty"),
    (lambda llm, ids: llm.generate([[]]), "the prompt is empty"),
    (lambda llm, ids: llm.generate([0] * 5000), "context holds"),
    (lambda llm, ids: llm.generate([ids, [10**6]]), r"prompt token ids must be integers in \[0, "),
    (lambda llm, ids: llm.generate([ids, ""]), "the prompt is empty"),
    (lambda llm, ids: llm.generate(ids, SamplingParams(max_tokens=0)), "max_tokens=0"),
    (lambda llm, ids: llm.generate(ids, SamplingParams(max_tokens=-3)), "max_tokens=-3"),
    (lambda llm, ids: llm.generate(ids, SamplingParams(temperature=-0.5)), "temperature=-0.5"),
    (lambda llm, ids: llm.generate(ids, SamplingParams(top_p=0.0)), r"top_p=0.0 .* \(0, 1\]"),
    (lambda llm, ids: llm.generate(ids, SamplingParams(top_p=1.5)), r"top_p=1.5 .* \(0, 1\]"),
    (lambda llm, ids: llm.generate([ids, ids], [SamplingParams()]), "got 1 SamplingParams for 2"),
])
def test_bad_requests_are_clear_errors_and_llm_keeps_serving(
        make_call, match, llm, prompt_ids, greedy_alone) -> None:
    with pytest.raises(ValueError, match=match):
        make_call(llm, prompt_ids[1])
    _still_serves(llm, prompt_ids, greedy_alone)


def test_duplicate_request_id_and_abort(llm, prompt_ids, greedy_alone) -> None:
    engine = llm.engine
    engine.add_request("dup", prompt_ids[1], GREEDY)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", prompt_ids[1], GREEDY)
    engine.step()  # the request now holds K/V slots
    assert engine.allocator.num_free < engine.allocator.num_usable
    engine.abort_request("dup")
    engine.abort_request("never-added")  # harmless
    _still_serves(llm, prompt_ids, greedy_alone)


def test_model_load_errors_leave_other_llm_serving(llm, prompt_ids, greedy_alone, tmp_path) -> None:
    garbage = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator())
    (tmp_path / "bad.gguf").write_bytes(garbage.numpy().tobytes())
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    for path, match in ((tmp_path / "missing", "does not exist"),
                        (tmp_path / "bad.gguf", "not a readable GGUF"),
                        (tmp_path / "gpt2", "unsupported architecture")):
        with pytest.raises(ValueError, match=match):
            LLM(str(path), num_threads=NUM_THREADS)
        _still_serves(llm, prompt_ids, greedy_alone)
