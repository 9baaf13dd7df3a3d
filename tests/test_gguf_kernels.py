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
from ngramspec.layers.gguf_linear import (
    AMX_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    GGUFWeight,
)

Q = gguf.GGMLQuantizationType
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # gguf-py dequantises these but cannot quantise them
TYPES = LEGACY + K_QUANTS
_HALF_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # fp16 d (and dmin) offsets


def _blocks(qtype, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """[out, bytes] blocks of random weights: gguf-py's quantisation where it has one, else
    random bytes with small finite fp16 scales (every bit pattern of the rest is a valid block)."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        return quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (out_features, in_features // size, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        scale = (rng.standard_normal((out_features, in_features // size, 1)) * 0.01).astype(np.float16)
        blocks[:, :, at : at + 2] = scale.view(np.uint8)
    return blocks.reshape(out_features, -1)


def _weight(qtype, out_features: int, in_features: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """Random weights in GGUF blocks, and gguf-py's float64 dequantisation of them (the reference)."""
    blocks = _blocks(qtype, out_features, in_features, seed)
    dense = torch.from_numpy(dequantize(blocks, qtype).astype(np.float64))
    return GGUFWeight(torch.from_numpy(np.ascontiguousarray(blocks)), int(qtype), in_features), dense


def _in_features(qtype, legacy: int) -> int:
    """A row length the type can hold: K-quants come in 256-weight super-blocks."""
    return 512 if qtype in K_QUANTS else legacy


AMX = [False, True] if cpu_kernels().amx_available() else [False]
# (type, on AMX tiles): every type on the vector kernel, the types AMX re-orders on it too
KERNEL_CASES = [(t, amx) for amx in AMX for t in TYPES if not amx or int(t) in AMX_TYPES]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                    set())


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux")
def test_the_vector_path_this_cpu_supports_is_compiled():
    """A CPU with AVX-512 or AVX2 (+FMA, F16C) must not fall back to the scalar loops (4x slower
    decode on an AVX2-only AMD Zen 2; this went unnoticed while only AVX-512 had a path)."""
    flags = _cpu_flags()
    tier = os.environ.get("NGRAMSPEC_CPU_ISA", "native")
    if tier in ("avx2", "scalar"):  # a tier chosen below this CPU's
        expected = tier
    elif "avx512f" in flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = "scalar"
    assert cpu_kernels().vector_isa() == expected


def test_an_isa_tier_is_named_and_checked_against_the_cpu(monkeypatch):
    """NGRAMSPEC_CPU_ISA picks the compile flags (each tier its own build directory), and a tier
    this CPU cannot run, or a misspelt one, stops with its name instead of a silent fallback."""
    from ngramspec import kernels

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})
    monkeypatch.setenv("NGRAMSPEC_CPU_ISA", "AVX2")
    assert kernels.isa_tier() == "avx2"
    assert "-march=x86-64-v3" in kernels._cflags()
    monkeypatch.setenv("NGRAMSPEC_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match=r"avx512 needs CPU flags \['avx512f'\]"):
        kernels.isa_tier()
    monkeypatch.setenv("NGRAMSPEC_CPU_ISA", "neon")
    with pytest.raises(ValueError, match="not a tier; use one of native, amx, avx512, avx2, scalar"):
        kernels.cpu_kernels.__wrapped__()
    monkeypatch.delenv("NGRAMSPEC_CPU_ISA")
    assert kernels.isa_tier() == "native" and "-march=native" in kernels._cflags()


@pytest.mark.parametrize(("qtype", "use_amx"), KERNEL_CASES,
                         ids=[f"{t.name}-{'amx' if a else 'vector'}" for t, a in KERNEL_CASES])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 40, 130])
def test_linear_matches_dequantised_matmul(qtype, rows, use_amx):
    """Every path: a decode row, fused tiles of a few rows, the panel micro-kernel (more rows
    than one fused tile, and more than one row chunk at 130 for K-quants' 512 inputs)."""
    out_features = 48 if use_amx else 44  # 44: not a multiple of the 8-output tile
    in_features = _in_features(qtype, 96)
    weight, dense = _weight(qtype, out_features, in_features, seed=rows)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    layer = GGUFLinear(weight, bias, use_amx=use_amx)
    assert layer.uses_amx == use_amx
    out = layer(x)
    # the AMX kernel multiplies bf16-rounded activations by the exact weights
    xr = x.bfloat16().double() if use_amx else x.double()
    ref = xr @ dense.T + bias.double()
    # fp32 sums of K / 16 products a lane, then 16 lanes: each term's rounding is bounded by
    # (K / 16 + 5) units of 2^-24 (6e-8) of the sum of |products|
    bound = (in_features / 16 + 5) * 6e-8 * (xr.abs() @ dense.abs().T) + 6e-8 * ref.abs() + 1e-6
    assert ((out.double() - ref).abs() <= bound).all()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(KERNEL_CASES), st.integers(1, 80), st.integers(1, 6), st.integers(0, 2**31))
def test_each_row_is_bitwise_the_same_alone_or_in_a_batch(case, rows, tiles, seed):
    """What keeps speculation lossless: a draft tree's rows equal each token run alone."""
    qtype, use_amx = case
    out_features = 16 * tiles if use_amx else 7 * tiles
    in_features = _in_features(qtype, 64)
    weight, _ = _weight(qtype, out_features, in_features, seed)
    layer = GGUFLinear(weight, use_amx=use_amx)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    batch = layer(x)
    for r in range(rows):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r])


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as gguf_int8.cpp quantises it, back in float64: per 32 values, q = round-half-even(x *
    127 / max|x|) (float32 products, as ggml's quantize_row_q8_0) times the scale max|x| / 127."""
    xc = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xc).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xc * inverse)
    assert np.abs(q).max() <= 127
    return torch.from_numpy((q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64))
                            .reshape(x.shape))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 130])
def test_int8_linear_is_the_quantised_rows_times_the_weights(qtype, rows):
    """int8 activations (llama.cpp's numerics): a decode row, panel tiles, more than one row
    chunk at 130. The chunks' integer dots are exact, so the only error left is the float
    accumulation of one term a chunk (and a B term a chunk) over K / 32 chunks."""
    in_features = _in_features(qtype, 96)
    weight, dense = _weight(qtype, 44, in_features, seed=rows)
    bias = torch.randn(44)
    x = torch.randn(rows, in_features) * torch.rand(rows, 1) * 4  # rows of different scales
    x[0, :32] = 0.0  # an all-zero chunk: scale 0, no division by it
    layer = GGUFLinear(weight, bias, int8=True)
    assert not layer.uses_amx and "int8" in layer.extra_repr()
    xq = _int8_rows(x)
    ref = xq @ dense.T + bias.double()
    bound = (in_features / 32 + 10) * 1.2e-7 * (xq.abs() @ dense.abs().T) + 1e-6
    assert ((layer(x).double() - ref).abs() <= bound).all()
    # and it is a different mode: float32 activations give other numbers
    assert not torch.equal(layer(x), GGUFLinear(weight, bias, use_amx=False)(x))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(TYPES), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31))
def test_int8_rows_are_bitwise_the_same_alone_or_in_a_batch(qtype, rows, tiles, seed):
    """Speculation stays lossless in the int8 mode: the one-row kernel and the panel tiles form
    every output's sum in the same order."""
    in_features = _in_features(qtype, 64)
    weight, _ = _weight(qtype, 7 * tiles, in_features, seed)
    layer = GGUFLinear(weight, int8=True)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    batch = layer(x)
    for r in range(rows):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r])


def test_rows_lookup_equals_dequantisation():
    for qtype in TYPES:
        weight, dense = _weight(qtype, 50, _in_features(qtype, 64), seed=3)
        ids = torch.tensor([0, 7, 49, 7])
        assert torch.equal(GGUFEmbedding(weight)(ids).double(), dense[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        GGUFEmbedding(weight)(torch.tensor([50]))


def test_bad_shapes_and_types_are_named():
    weight, _ = _weight(TYPES[1], 8, 64, seed=0)
    with pytest.raises(ValueError, match="do not hold"):
        GGUFWeight(weight.blocks[:, :-1].contiguous(), weight.qtype, 64)
    with pytest.raises(ValueError, match="no kernel"):
        GGUFWeight(weight.blocks, 10, 64)  # Q2_K
    with pytest.raises(ValueError, match="in % 256 == 0"):
        GGUFWeight(torch.zeros(8, 144, dtype=torch.uint8), 12, 288)  # Q4_K rows are 256-weight blocks
    packed = cpu_kernels().gguf_pack(weight.blocks, weight.qtype, 64)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels().gguf_linear(torch.randn(2, 64, dtype=torch.float64), packed,
                                   weight.qtype, 8, None)
    with pytest.raises(RuntimeError, match="bytes a row"):
        cpu_kernels().gguf_linear(torch.randn(2, 96), packed, weight.qtype, 8, None)
    with pytest.raises(RuntimeError, match="do not fit packed weights"):
        cpu_kernels().gguf_linear(torch.randn(2, 64), packed, weight.qtype, 9, None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels().gguf_linear_int8(torch.randn(2, 64).half(), packed, weight.qtype, 8, None)
    # Q4_1 runs outputs in lanes from gguf_pack_int8's layout, not gguf_pack's
    with pytest.raises(RuntimeError, match="packed by gguf_pack_int8"):
        cpu_kernels().gguf_linear_int8(torch.randn(2, 64), packed, weight.qtype, 8, None)
    q4k, _ = _weight(Q.Q4_K, 8, 256, seed=0)
    with pytest.raises(RuntimeError, match="bytes a row"):  # blocks of another row length
        cpu_kernels().gguf_pack_int8(q4k.blocks, q4k.qtype, 512)
    q4k_packed = cpu_kernels().gguf_pack_int8(q4k.blocks, q4k.qtype, 256)
    with pytest.raises(RuntimeError, match="are not 8 outputs of 512 inputs"):
        cpu_kernels().gguf_linear_int8(torch.randn(2, 512), q4k_packed, q4k.qtype, 8, None)


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
    # int8 activations by default (the bench quality rule), float32 on request, never off-GGUF
    assert EngineConfig().gguf_int8 and not EngineConfig(gguf_activations="float32").gguf_int8
    assert not EngineConfig(dtype="float32", gguf_activations="int8").gguf_int8
    with pytest.raises(ValueError, match="gguf_activations='int4'"):
        EngineConfig(gguf_activations="int4")


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
    if plain.engine.runner.model.stack is None:
        assert cpu_kernels().amx_available()  # only AMX tiles keep the Python layers here
        return
    # the decoder stack calls a mixed matrix's pieces as GGUFStack does: bitwise the same
    runs = []
    for layers in (model.stack, None):
        model.stack = layers
        plain.engine.scheduler.flush_cache()
        outs = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                      prompt_logprobs=3))
        runs.append([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs])
    assert runs[0] == runs[1]
