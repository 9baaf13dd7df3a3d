import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        # One fused op instead of six (about 6 us saved per call at batch 1, 61 calls a step);
        # bitwise equal to HF's formula in fp32; in bf16 it applies the weight before rounding
        # (HF rounds before and after), so it differs by one bf16 rounding at most.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
