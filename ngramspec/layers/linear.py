"""Linear layer that uses oneDNN on CPU, with the weight reordered once into oneDNN's layout.

MKL's sgemm (what F.linear calls on CPU) switches from a matrix-vector to a matrix-matrix path
between 1 and 2 rows, so verifying a few draft tokens costs almost twice one token. oneDNN's
matmul on a plain weight is flatter, and on a weight reordered once into its blocked layout it is
flat: on SmolLM2's shapes 2 to 4 rows cost about as much as 1, and every row count up to a
128-token prefill chunk is faster than unpacked too. That flat curve is what makes verifying a
draft tree nearly free on a CPU.

bf16 weights on a CPU with AMX run on AMX tiles instead (`kernels/amx_dense.cpp`): oneDNN's bf16
blocking depends on the row count, so a token's sums differ inside a draft tree and bf16
speculation drifts from bf16 plain decoding; the tile kernel computes each row as it would alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN tunes the packed layout for; measured flat from 4 to 128 rows.
PACK_ROWS_HINT = 16


@functools.cache
def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's inner product runs here (asked once: `forward` checks every call).
    bf16 needs AVX-512; on an AVX2-only CPU (e.g. AMD Zen 2/3) oneDNN cannot create the
    primitive, so bf16 goes through F.linear there."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return _ONEDNN_DTYPES if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _onednn_ok(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype in _onednn_dtypes()


def _amx_bf16_kernels():
    """The compiled kernels if bf16 AMX tiles run here, else None."""
    from ngramspec.kernels import cpu_kernels, kernels_available

    if not kernels_available():
        return None
    kernels = cpu_kernels()
    return kernels if kernels.amx_available() else None


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU only), or None
    amx: torch.Tensor | None = None  # bf16 weight in AMX tile order (CPU with AMX), or None

    def pack(self) -> None:
        """Reorder the weight for oneDNN; call after the last dtype/device move (and after any
        weight tying: the packed module stops sharing its weight).

        oneDNN's packed weight gives the plain one back exactly (`to_dense`), so the plain copy
        is dropped: each engine would otherwise hold every matrix twice in host memory. The
        state dict and the fallback path rebuild it from the packed copy.
        """
        self.packed = self.amx = None
        w = self.weight
        if (w.is_cpu and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0
                and (kernels := _amx_bf16_kernels()) is not None):
            self._kernels = kernels
            self.amx = kernels.amx_pack_bf16(w.detach())
            return
        if not _onednn_ok(w):
            return
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
        except RuntimeError:  # e.g. bf16 on a CPU whose oneDNN build lacks it: stay unpacked
            return
        if not packed.is_mkldnn:  # no exact way back to the plain weight: keep both
            self.packed = packed
            return
        self.packed = packed
        # A placeholder of the weight's dtype: the plain matrix lives on in `packed`.
        self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        """The plain [out, in] weight (rebuilt from the packed copy when it was dropped)."""
        if self.packed is not None and self.weight.numel() == 0:
            return self.packed.to_dense()
        return self.weight

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.amx is not None and x.is_cpu and x.dtype == torch.bfloat16:
            return self._kernels.amx_linear_bf16(x, self.amx, self.bias).to(x.dtype)
        if _onednn_ok(x):
            weight = self.packed if self.packed is not None else self.weight
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        return F.linear(x, self.dense_weight(), self.bias)


def pack_linears(model: nn.Module) -> None:
    """Pack every `Linear` of `model` for oneDNN (a no-op off CPU)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
