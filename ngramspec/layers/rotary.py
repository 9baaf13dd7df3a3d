from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), with cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTable:
        """cos and sin of a step's positions, looked up once and shared by every layer."""
        # positions: [T] -> cos, sin: [T, 1, D]
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))


RotaryTable = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D]


def apply_rotary(table: RotaryTable, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D]; k: [T, KVH, D]
    cos, sin = table
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
