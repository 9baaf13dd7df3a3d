"""Attention over a token-granular paged KV cache.

The reference backend gathers each sequence's K/V by slot into a padded batch and runs SDPA
with an explicit boolean mask. Any set of query tokens per sequence is allowed, with their own
positions and an arbitrary mask over (cached prefix + query tokens): a causal prefill chunk, a
single decode token and a draft tree are all just masks. A faster backend (e.g. flashinfer on
CUDA) can replace `ReferenceAttention` behind the same `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries are padded together: one SDPA call.

    Sequences are grouped by query length so that one draft tree or prefill chunk does not pad
    every single-token decode in the batch to its length (attention work is B * Q * L).
    """

    query_index: torch.Tensor  # [B, Q] flat token index of each padded query row (pad -> 0)
    kv_slots: torch.Tensor  # [B, L] cache slots each sequence attends to (pad -> 0)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True = may attend
    output_index: torch.Tensor  # [Tg] row of each real query in the flattened [B * Q] output
    token_index: torch.Tensor | None  # [Tg] flat index of those queries; None = all, in order


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each query token
    groups: list[AttentionGroup]


class KVCache:
    """K/V storage for all layers: one row per slot, shared by every sequence."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ReferenceAttention:
    """Plain PyTorch SDPA; runs on CPU and CUDA."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D] -> out [T, H * D]
        cache.k[layer].index_copy_(0, meta.slot_mapping, k)
        cache.v[layer].index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].token_index is None:
            return self._group(layer, q, cache, meta.groups[0])
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
        for group in meta.groups:
            out[group.token_index] = self._group(layer, q, cache, group)
        return out

    @staticmethod
    def _group(layer: int, q: torch.Tensor, cache: KVCache, g: AttentionGroup) -> torch.Tensor:
        b, q_len = g.query_index.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        qb = q[g.query_index].transpose(1, 2)  # [B, H, Q, D]
        kb = cache.k[layer][g.kv_slots].transpose(1, 2)  # [B, KVH, L, D]
        vb = cache.v[layer][g.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * q_len, num_heads * head_dim)  # [B * Q, H * D]
        return out[g.output_index]  # [Tg, H * D]
