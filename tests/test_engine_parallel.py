"""Tensor parallelism (engine/parallel.py): slices that add up to the model, and two gloo
processes that decode exactly as one, with speculation on."""

from __future__ import annotations

import random

import pytest
import torch

from ngramspec import LLM, SamplingParams
from ngramspec.engine.parallel import check_divisible, shard_config, shard_state_dict
from ngramspec.models.loader import load_model_config, load_state_dict

FLAT_COST = [1.0] * 14  # verify cost independent of size: always draft the full tree


def test_slices_cover_every_weight_once(tiny_model_dirs):
    cfg = load_model_config(tiny_model_dirs["qwen2"])  # q/k/v biases
    full = load_state_dict(tiny_model_dirs["qwen2"])
    shards = [shard_state_dict(full, cfg, rank, 2) for rank in range(2)]
    for name, w in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w), name
        elif any(f"{m}." in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat(parts, 0), w), name
        else:
            assert all(p is w for p in parts), name  # replicated, not copied
    half = shard_config(cfg, 2)
    assert (half.num_heads, half.num_kv_heads) == (cfg.num_heads // 2, cfg.num_kv_heads // 2)
    assert half.head_dim == cfg.head_dim
    with pytest.raises(ValueError, match="num_heads"):
        check_divisible(cfg, 3)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(30)]
    # repeated spans give the drafter something to propose on every request
    return [base + base[:10], base[5:25] * 2, [rng.randrange(3, 500) for _ in range(12)]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_gloo_ranks_decode_as_one_process(tiny_model_dirs, arch):
    options = dict(model=str(tiny_model_dirs[arch]), num_threads=1, speculative="ngram",
                   verify_cost=FLAT_COST)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    params = [greedy, greedy, seeded]  # rank 0 samples: a seed reproduces across layouts
    single = LLM(**options)
    expected = single.generate(_prompts(), params)
    parallel = LLM(tensor_parallel_size=2, **options)
    try:
        got = parallel.generate(_prompts(), params)
        stats = parallel.engine.stats
    finally:
        parallel.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert stats.num_accepted_tokens > 0  # drafts were verified on both ranks


def test_a_dead_follower_is_a_clear_error_not_a_hang(tiny_model_dirs):
    from ngramspec.engine.model_runner import ForwardItem

    parallel = LLM(model=str(tiny_model_dirs["llama"]), num_threads=1, tensor_parallel_size=2)
    runner = parallel.engine.runner
    try:
        item = ForwardItem([5, 6, 7], [0, 1, 2], [], [1, 2, 3], None, [2])
        assert runner.run([item]).shape == (1, 512)
        runner.workers[0].kill()
        runner.workers[0].join()
        with pytest.raises(RuntimeError, match="exited"):
            runner.run([item])
        with pytest.raises(RuntimeError, match="broken"):
            runner.run([item])
    finally:
        parallel.close()


def test_tensor_parallel_config_errors(tiny_model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(tiny_model_dirs["llama"]), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gguf"):
        LLM(model=str(tiny_model_dirs["llama"]), tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="does not divide"):
        LLM(model=str(tiny_model_dirs["llama"]), tensor_parallel_size=3)
