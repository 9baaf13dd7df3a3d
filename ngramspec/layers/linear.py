"""Linear layer that uses oneDNN on CPU.

MKL's sgemm (what F.linear calls on CPU) switches from a matrix-vector to a matrix-matrix path
between 1 and 2 rows, so verifying a few draft tokens costs almost twice one token. oneDNN's
matmul stays flat for small row counts (measured here on SmolLM2: 1 -> 8 tokens costs ~1.2x
instead of ~1.7x), which is what makes tree verification pay on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if x.is_cpu and x.dtype in _ONEDNN_DTYPES and torch.backends.mkldnn.is_available():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
