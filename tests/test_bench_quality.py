"""bench quality's measures on a tiny model: a mode against itself agrees fully with zero KL,
and a different mode is measured as different."""

from __future__ import annotations

from ngramspec import LLM, SamplingParams
from ngramspec.bench.quality_bench import compare, matching_prefix


def test_matching_prefix() -> None:
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matching_prefix([1, 2], [1, 2, 3]) == 2
    assert matching_prefix([], [1]) == 0


def test_a_mode_against_itself_and_against_bfloat16(tiny_model_dirs) -> None:
    model = str(tiny_model_dirs["llama"])
    ref = LLM(model, dtype="float32", num_threads=2)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8, 1, 250, 14, 9]]
    same = compare(ref, LLM(model, dtype="float32", num_threads=2), prompts, max_tokens=12,
                   mode="same")
    assert same.positions == 24
    assert same.argmax_agreement == 1.0 and abs(same.mean_kl) < 1e-6
    assert same.mean_matching_prefix == 12
    bf16 = compare(ref, LLM(model, dtype="bfloat16", num_threads=2), prompts, max_tokens=12,
                   mode="bfloat16")
    assert bf16.mode == "bfloat16"
    assert bf16.mean_kl > 1e-7, "bfloat16 measured as identical to float32: the scorer is blind"


def test_llama_server_agreement_is_measured_position_by_position(tiny_model_dirs, tmp_path,
                                                                  llama_server_stub) -> None:
    from ngramspec.bench.quality_bench import compare_llama_server

    ref = LLM(str(tiny_model_dirs["llama"]), dtype="float32", num_threads=2)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8, 1, 250, 14, 9]]
    r = compare_llama_server(llama_server_stub, tmp_path / "m.gguf", 2, ref, prompts, max_tokens=10)
    params = SamplingParams(temperature=0, max_tokens=10)
    outs = [o.token_ids for o in ref.generate(prompts, params)]
    # the stand-in predicts each position's previous token
    hits = sum((p + o)[len(p) + i - 1] == o[i]
               for p, o in zip(prompts, outs) for i in range(len(o)))
    assert r.mode == "llama-server" and r.positions == 20 and r.mean_kl is None
    assert r.argmax_agreement == hits / 20
    repeats = [matching_prefix(o, [p[-1]] * len(o)) for p, o in zip(prompts, outs)]
    assert r.mean_matching_prefix == sum(repeats) / 2
