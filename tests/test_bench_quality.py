"""bench quality's measures on a tiny model: a mode against itself agrees fully with zero KL,
and a different mode is measured as different."""

from __future__ import annotations

from ngramspec import LLM
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
