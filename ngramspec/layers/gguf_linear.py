"""Linear and embedding layers that keep their weights in GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K: what Q4_K_M, Q5_K_M, Q4_0 and Q8_0 files hold).

The blocks are the GGUF file's own bytes (rows only permuted where llama.cpp permuted q/k),
dequantised in registers with fp32 accumulation. Both kernels compute each row of a batch exactly
as it would alone, so one token and a draft tree see bitwise-equal linear outputs: speculation
stays lossless against this mode's plain decoding. Activations between layers stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from ngramspec.kernels import cpu_kernels

_Q = GGMLQuantizationType
# the ggml types the kernel runs; gguf's GGML_QUANT_SIZES gives each (weights, bytes) a block
KERNEL_TYPES = frozenset(int(q) for q in (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K,
                                          _Q.Q5_K, _Q.Q6_K))
AMX_TYPES = frozenset(int(q) for q in (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0))  # amx_linear.cpp's tiles


def block_size(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of ggml type `qtype`."""
    return GGML_QUANT_SIZES[_Q(qtype)]


def type_name(qtype: int) -> str:
    return _Q(qtype).name


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """One [out, in] matrix as GGUF blocks: `blocks` is [out, in / 32 * block_bytes] uint8."""

    blocks: torch.Tensor
    qtype: int
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_TYPES:
            raise ValueError(f"GGUF type {self.qtype} has no kernel "
                             f"(have {sorted(type_name(q) for q in KERNEL_TYPES)})")
        size, nbytes = block_size(self.qtype)
        if self.in_features % size or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"GGUF blocks must be uint8 [out, in / {size} * block_bytes], in % {size} == 0")
        if self.blocks.shape[1] != self.in_features // size * nbytes:
            raise ValueError(f"GGUF blocks of shape {tuple(self.blocks.shape)} do not hold "
                             f"{self.in_features} {type_name(self.qtype)} weights a row")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @staticmethod
    def concat(parts: list[GGUFWeight]) -> GGUFWeight | None:
        """Rows of several matrices stacked (fused q/k/v, gate/up); None if their types differ."""
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            return None
        return GGUFWeight(torch.cat([p.blocks for p in parts]), parts[0].qtype, parts[0].in_features)


class GGUFLinear(nn.Module):
    """With int8 activations (`int8=True`, llama.cpp's numerics) each input row is quantised per
    32 values and multiplied in integers (`gguf_int8.cpp`). Else, on a CPU with AMX (bf16 tiles)
    Q4_0 / Q4_1 / Q8_0 blocks are re-ordered once into AMX tiles and 1 to 16 rows cost about the
    same (`amx_linear.cpp`: activations rounded to bf16, fp32 sums), and elsewhere the vector
    kernel runs them in fp32 throughout (`gguf_kernels.cpp`). The non-AMX kernels read the
    blocks packed in groups of 8 rows with interleaved blocks, the same bits."""

    def __init__(self, weight: GGUFWeight, bias: torch.Tensor | None = None,
                 use_amx: bool | None = None, int8: bool = False) -> None:
        super().__init__()
        self.qtype, self.in_features = weight.qtype, weight.in_features
        self.out_features = weight.out_features
        self.int8 = int8
        self._kernels = cpu_kernels()
        if use_amx is None:
            use_amx = self._kernels.amx_available()
        self.uses_amx = (use_amx and not int8 and self.out_features % 16 == 0
                         and self.qtype in AMX_TYPES)
        blocks = weight.blocks.contiguous()
        if self.uses_amx:
            blocks = self._kernels.amx_pack(blocks, self.qtype, self.in_features)
        elif int8:  # 8 outputs' levels side by side (gguf_int8.cpp)
            blocks = self._kernels.gguf_pack_int8(blocks, self.qtype, self.in_features)
        else:  # 8 rows' blocks interleaved: one contiguous stream per 8-output tile
            blocks = self._kernels.gguf_pack(blocks, self.qtype, self.in_features)
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] float32 -> [T, out]
        if self.uses_amx:
            return self._kernels.amx_linear(x, self.blocks, self.qtype, self.bias)
        linear = self._kernels.gguf_linear_int8 if self.int8 else self._kernels.gguf_linear
        return linear(x, self.blocks, self.qtype, self.out_features, self.bias)

    def extra_repr(self) -> str:
        kernel = "amx" if self.uses_amx else self._kernels.vector_isa()
        if self.int8:
            kernel += " int8"
        return f"{self.in_features}, {self.out_features}, {type_name(self.qtype)}, {kernel}"


class GGUFStack(nn.Module):
    """Matrices of different block types whose outputs the model fuses (q/k/v, gate/up): one
    kernel call per matrix, outputs side by side. Each part is row-invariant, so the whole is."""

    def __init__(self, parts: list[GGUFWeight], bias: torch.Tensor | None = None,
                 int8: bool = False) -> None:
        super().__init__()
        sizes = [p.out_features for p in parts]
        biases = list(bias.split(sizes)) if bias is not None else [None] * len(parts)
        self.parts = nn.ModuleList(GGUFLinear(w, b, int8=int8) for w, b in zip(parts, biases))
        self.in_features, self.out_features = parts[0].in_features, sum(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] float32 -> [T, sum(out)]
        return torch.cat([p(x) for p in self.parts], dim=1)


def gguf_linear(parts: list[GGUFWeight], bias: torch.Tensor | None = None,
                int8: bool = False) -> nn.Module:
    """One module for the rows of `parts` stacked: a single kernel when their types agree."""
    fused = GGUFWeight.concat(parts)
    return GGUFLinear(fused, bias, int8=int8) if fused is not None else GGUFStack(parts, bias, int8)


class GGUFEmbedding(nn.Module):
    def __init__(self, weight: GGUFWeight) -> None:
        super().__init__()
        self.qtype, self.embedding_dim = weight.qtype, weight.in_features
        self.register_buffer("blocks", weight.blocks.contiguous())
        self._kernels = cpu_kernels()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] -> [T, dim] float32
        return self._kernels.gguf_rows(self.blocks, ids, self.qtype, self.embedding_dim)
