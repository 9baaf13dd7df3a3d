from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    ops: ModuleType | None = None  # the fused CPU kernels (ngramspec.kernels), or None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x): [..., dim]; with `residual`: (norm(residual + x), residual + x)."""
        if residual is not None:
            if self.ops is not None and x.dim() == 2:  # one pass; residual updated in place
                return self.ops.add_rms_norm(residual, x, self.weight, self.eps), residual
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # bitwise equal to HF's formula in fp32; in bf16 it applies the weight before rounding
        # (HF rounds before and after), so it differs by one bf16 rounding at most.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
