"""Attention over a token-granular paged KV cache.

On CPU, `PagedAttention` (a C++ kernel) reads each token's keys in place from its sequence's
slot list. The reference backend (CUDA, and the tests' oracle) runs SDPA with an explicit
boolean mask. A group of one sequence whose
slots form one contiguous range reads its K/V as a view of the cache (no copy; the allocator
hands out lowest slots first, so a lone sequence stays contiguous); other groups gather their
K/V by slot into a padded batch. Any set of query tokens per sequence is allowed, with their own
positions and an arbitrary mask over (cached prefix + query tokens): a causal prefill chunk, a
single decode token and a draft tree are all just masks. A faster backend (e.g. flashinfer on
CUDA) can replace `ReferenceAttention` behind the same `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries are padded together: one SDPA call.

    Sequences are grouped by query length so that one draft tree or prefill chunk does not pad
    every single-token decode in the batch to its length (attention work is B * Q * L).
    """

    query_index: torch.Tensor | None  # [B, Q] flat token index of each padded query row (pad ->
    # 0); None = the step's tokens in order, one sequence, no padding
    kv_slots: torch.Tensor | None  # [B, L] cache slots each sequence attends to (pad -> 0)
    kv_range: tuple[int, int] | None  # instead of kv_slots: one sequence reading slots [lo, hi)
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = may attend; None = everything
    output_index: torch.Tensor | None  # [Tg] row of each real query in the [B * Q] output; None =
    # all rows
    token_index: torch.Tensor | None  # [Tg] flat index of those queries; None = all, in order


@dataclass(slots=True)
class PagedMetadata:
    """What the in-place CPU kernel reads: each query token's ordered key list is its sequence's
    cached prefix followed by its own visible query-token slots (itself, tree ancestors)."""

    seq_offsets: torch.Tensor  # [B + 1] query tokens of sequence b are rows [o_b, o_b+1)
    prefix: torch.Tensor  # [P] cached slots of every sequence, concatenated in position order
    prefix_offsets: torch.Tensor  # [B + 1] sequence b's prefix is prefix[o_b : o_b+1]
    local: torch.Tensor  # [N] visible query-token slots of the tree tokens, concatenated
    local_offsets: torch.Tensor  # [T + 1] token t's are local[o_t : o_t+1] (empty when causal)
    causal: torch.Tensor  # [B] int64, 1 = token i of the sequence sees its query slots 0..i
    max_query_len: int  # the most query tokens of one sequence (the Triton kernel's grid)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each query token
    groups: list[AttentionGroup]  # for ReferenceAttention (SDPA)
    paged: PagedMetadata | None = None  # for PagedAttention (CPU kernel)


class KVCache:
    """K/V storage for all layers: one row per slot, shared by every sequence."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)  # [layers, slots, KVH, D]
        self.v = _zeros(shape, dtype, device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V ([T, KVH, D]) at their slots, in the cache's dtype."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where written, on the CPU: numpy's zeros come from calloc,
    whose large blocks are fresh zero pages the kernel maps in on first touch, where torch.zeros
    writes every byte (a 1 GiB K/V pool would be resident before its first request)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros((*shape[:-1], shape[-1] * size), np.uint8)
    return torch.from_numpy(raw).view(dtype)


class ReferenceAttention:
    """Plain PyTorch SDPA; runs on CPU and CUDA."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D] -> out [T, H * D]
        cache.write(layer, meta.slot_mapping, k, v)
        if len(meta.groups) == 1 and meta.groups[0].token_index is None:
            return self._group(layer, q, cache, meta.groups[0])
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
        for group in meta.groups:
            out[group.token_index] = self._group(layer, q, cache, group)
        return out

    @staticmethod
    def _group(layer: int, q: torch.Tensor, cache: KVCache, g: AttentionGroup) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        if g.query_index is None:
            b, q_len = 1, q.shape[0]
            qb = q.unsqueeze(0)  # [1, T, H, D]
        else:
            b, q_len = g.query_index.shape
            qb = q.index_select(0, g.query_index.view(-1)).view(b, q_len, num_heads, head_dim)
        kb, vb = _keys_values(layer, cache, g)  # [B, L, KVH, D]
        out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2),
                                             vb.transpose(1, 2), attn_mask=g.mask,
                                             enable_gqa=True)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(b * q_len, num_heads * head_dim)  # [B * Q, H * D]
        return out if g.output_index is None else out[g.output_index]  # [Tg, H * D]


class PagedAttention:
    """The CPU kernel `ngramspec/kernels/attention.cpp`: K/V read in place, no padding, no
    [queries x context] mask, and batch-invariant (a token's output is bitwise the same alone or
    inside a draft tree), which keeps speculation lossless in every dtype."""

    def __init__(self) -> None:
        from ngramspec.kernels import cpu_kernels

        self._kernels = cpu_kernels()

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D] -> out [T, H * D]
        p = meta.paged
        assert p is not None, "PagedAttention needs AttentionMetadata.paged"
        return self._kernels.paged_attention(  # q, k, v: strided views of the fused qkv row
            q, k, v, cache.k[layer], cache.v[layer],
            meta.slot_mapping, p.seq_offsets, p.prefix, p.prefix_offsets, p.local,
            p.local_offsets, p.causal, q.shape[-1] ** -0.5)


def _keys_values(layer: int, cache: KVCache, g: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L, KVH, D] keys and values of a group: a view of the cache, or gathered by slot."""
    k, v = cache.k[layer], cache.v[layer]  # [slots, KVH, D]
    if g.kv_range is not None:
        lo, hi = g.kv_range
        return k[lo:hi].unsqueeze(0), v[lo:hi].unsqueeze(0)
    assert g.kv_slots is not None
    b, length = g.kv_slots.shape
    flat = g.kv_slots.view(-1)
    # index_select copies rows 2-5x faster than advanced indexing here (measured at 128-3500).
    return (k.index_select(0, flat).view(b, length, *k.shape[1:]),
            v.index_select(0, flat).view(b, length, *v.shape[1:]))
