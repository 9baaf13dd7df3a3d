"""The GGUF block kernel against gguf-py's own dequantisation, and its row invariance."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.kernels import cpu_kernels
from ngramspec.layers.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFWeight

TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
         gguf.GGMLQuantizationType.Q8_0]


def _weight(qtype, out_features: int, in_features: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """Random weights quantised by gguf-py, and their float64 dequantisation (the reference)."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    blocks = quantize(w, qtype)
    dense = torch.from_numpy(dequantize(blocks, qtype).astype(np.float64))
    return GGUFWeight(torch.from_numpy(blocks), int(qtype), in_features), dense


AMX = [False, True] if cpu_kernels().amx_available() else [False]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                    set())


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux")
def test_the_vector_path_this_cpu_supports_is_compiled():
    """A CPU with AVX-512 or AVX2 (+FMA, F16C) must not fall back to the scalar loops (4x slower
    decode on an AVX2-only AMD Zen 2; this went unnoticed while only AVX-512 had a path)."""
    flags = _cpu_flags()
    if "avx512f" in flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = "scalar"
    assert cpu_kernels().vector_isa() == expected


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 40])
@pytest.mark.parametrize("use_amx", AMX, ids=["vector", "amx"][: len(AMX)])
def test_linear_matches_dequantised_matmul(qtype, rows, use_amx):
    out_features = 48 if use_amx else 44  # 44: not a multiple of the 8-output tile
    weight, dense = _weight(qtype, out_features, 96, seed=rows)
    bias = torch.randn(out_features)
    x = torch.randn(rows, 96)
    layer = GGUFLinear(weight, bias, use_amx=use_amx)
    assert layer.uses_amx == use_amx
    out = layer(x)
    # the AMX kernel multiplies bf16-rounded activations by the exact weights
    xr = x.bfloat16().double() if use_amx else x.double()
    ref = xr @ dense.T + bias.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TYPES), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31),
       st.sampled_from(AMX))
def test_each_row_is_bitwise_the_same_alone_or_in_a_batch(qtype, rows, tiles, seed, use_amx):
    """What keeps speculation lossless: a draft tree's rows equal each token run alone."""
    out_features = 16 * tiles if use_amx else 7 * tiles
    weight, _ = _weight(qtype, out_features, 64, seed)
    layer = GGUFLinear(weight, use_amx=use_amx)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    batch = layer(x)
    for r in range(rows):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r])


def test_rows_lookup_equals_dequantisation():
    for qtype in TYPES:
        weight, dense = _weight(qtype, 50, 64, seed=3)
        ids = torch.tensor([0, 7, 49, 7])
        assert torch.equal(GGUFEmbedding(weight)(ids).double(), dense[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        GGUFEmbedding(weight)(torch.tensor([50]))


def test_bad_shapes_and_types_are_named():
    weight, _ = _weight(TYPES[1], 8, 64, seed=0)
    with pytest.raises(ValueError, match="do not hold"):
        GGUFWeight(weight.blocks[:, :-1].contiguous(), weight.qtype, 64)
    with pytest.raises(ValueError, match="no kernel"):
        GGUFWeight(weight.blocks, 12, 64)  # Q4_K
    packed = cpu_kernels().gguf_pack(weight.blocks, weight.qtype, 64)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels().gguf_linear(torch.randn(2, 64, dtype=torch.float64), packed,
                                   weight.qtype, 8, None)
    with pytest.raises(RuntimeError, match="bytes a row"):
        cpu_kernels().gguf_linear(torch.randn(2, 96), packed, weight.qtype, 8, None)
    with pytest.raises(RuntimeError, match="do not fit packed weights"):
        cpu_kernels().gguf_linear(torch.randn(2, 64), packed, weight.qtype, 9, None)


def test_quantization_auto_picks_the_gguf_kernels_for_a_gguf_model_on_cpu():
    from ngramspec.config import EngineConfig

    assert EngineConfig().uses_gguf_kernels  # the bundled GGUF
    assert EngineConfig().torch_kv_dtype == torch.bfloat16
    assert not EngineConfig(dtype="float32").uses_gguf_kernels  # the HF-golden mode
    assert EngineConfig(dtype="float32").torch_kv_dtype == torch.float32
    assert not EngineConfig(model="/models/llama-dir").uses_gguf_kernels
    assert EngineConfig(quantization="gguf", model="x.gguf").uses_gguf_kernels
    with pytest.raises(ValueError, match="computes in float32"):
        EngineConfig(quantization="gguf", dtype="bfloat16")


# ------------------------------------------------------------------ dense bf16 on AMX tiles

needs_amx = pytest.mark.skipif(not cpu_kernels().amx_available(), reason="no AMX bf16 tiles here")


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_bf16_linear_on_tiles_matches_matmul(rows):
    from ngramspec.layers.linear import Linear

    layer = Linear(96, 48).to(torch.bfloat16)
    layer.pack()
    assert layer.amx is not None
    x = torch.randn(rows, 96).bfloat16()
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output
    exact = cpu_kernels().amx_linear_bf16(x, layer.amx, None).double()  # fp32 sums
    torch.testing.assert_close(exact, x.double() @ layer.weight.double().T, rtol=1e-5, atol=1e-4)


@needs_amx
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31))
def test_bf16_tile_rows_are_bitwise_the_same_alone_or_in_a_batch(rows, tiles, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * tiles, 32 * blocks, generator=g).bfloat16()
    packed = cpu_kernels().amx_pack_bf16(w)
    x = torch.randn(rows, 32 * blocks, generator=g).bfloat16()
    batch = cpu_kernels().amx_linear_bf16(x, packed, None)
    for r in range(rows):
        assert torch.equal(cpu_kernels().amx_linear_bf16(x[r : r + 1], packed, None)[0], batch[r])


def test_mixed_block_types_run_one_kernel_per_matrix_and_stay_lossless(tiny_gguf):
    """Layer 0 of the tiny GGUF mixes types inside q/k/v and gate/up: one kernel per matrix,
    outputs side by side; greedy speculation still equals plain decoding."""
    from ngramspec import LLM, SamplingParams
    from ngramspec.layers.gguf_linear import GGUFStack

    plain = LLM(model=str(tiny_gguf), num_threads=2, quantization="gguf")
    model = plain.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFStack)
    assert isinstance(model.layers[0].mlp.gate_up_proj, GGUFStack)
    assert isinstance(model.layers[1].self_attn.qkv_proj, GGUFLinear)
    x = torch.randn(5, 64)
    stack = model.layers[0].self_attn.qkv_proj
    assert torch.equal(stack(x), torch.cat([p(x) for p in stack.parts], dim=1))
    spec = LLM(model=str(tiny_gguf), num_threads=2, quantization="gguf", speculative="ngram",
               verify_cost=[1.0] * 14)
    prompts = [[5, 17, 42, 99, 7, 3] * 4, list(range(100, 140)) * 2, [9, 8, 7, 6] * 10]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt in prompts:
        assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    assert spec.engine.stats.num_accepted_tokens > 0
