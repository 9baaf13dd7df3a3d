"""The GGUF block kernel against gguf-py's own dequantisation, and its row invariance."""

from __future__ import annotations

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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 40])
def test_linear_matches_dequantised_matmul(qtype, rows):
    weight, dense = _weight(qtype, 44, 96, seed=rows)  # 44: not a multiple of the 8-output tile
    bias = torch.randn(44)
    x = torch.randn(rows, 96)
    out = GGUFLinear(weight, bias)(x)
    ref = x.double() @ dense.T + bias.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(TYPES), st.integers(1, 24), st.integers(1, 40), st.integers(0, 2**31))
def test_each_row_is_bitwise_the_same_alone_or_in_a_batch(qtype, rows, out_features, seed):
    """What keeps speculation lossless: a draft tree's rows equal each token run alone."""
    weight, _ = _weight(qtype, out_features, 64, seed)
    layer = GGUFLinear(weight)
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
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels().gguf_linear(torch.randn(2, 64, dtype=torch.float64), weight.blocks,
                                   weight.qtype, None)
    with pytest.raises(RuntimeError, match="bytes a row"):
        cpu_kernels().gguf_linear(torch.randn(2, 96), weight.blocks, weight.qtype, None)
