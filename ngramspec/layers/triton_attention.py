"""Attention over the paged KV cache in one Triton kernel (the CUDA path).

It reads the same `PagedMetadata` as the CPU kernel (layers/attention.py): every query token's
ordered key list is its sequence's cached prefix, then its own visible query-token slots (its tree
ancestors and itself, or the causal run of its chunk). One program per (query token, KV head)
walks that list in blocks with an online softmax, computing the group's query heads together, so
K/V are read in place by slot: no padding, no gather copy, no [queries x keys] mask built per
sequence. Scores and sums are float32 whatever the cache dtype.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how
tests/test_triton_attention.py checks it against the SDPA reference on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ngramspec.layers.attention import AttentionMetadata, KVCache

BLOCK_KEYS = 32


@triton.jit
def _attend(q, k_cache, v_cache, slots, valid, kv_head, stride_ks, stride_kh, d, d_valid,
            m_i, l_i, acc, scale):
    """Fold one block of keys into the running softmax of the group's query heads."""
    kv_mask = valid[:, None] & d_valid[None, :]
    at = slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    k = tl.load(k_cache + at, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
    v = tl.load(v_cache + at, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])  # [G, N]
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
    return m_new, l_i, acc


@triton.jit
def _paged_attention(q_ptr, k_cache, v_cache, out_ptr, slot_mapping, token_seq, seq_offsets,
                     prefix, prefix_offsets, local, local_offsets, causal, stride_qt, stride_qh,
                     stride_ks, stride_kh, stride_ot, scale, GROUP: tl.constexpr,
                     GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(token_seq + t)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_valid = g < GROUP
    d_valid = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)  # [G, D]
    # Finite start: a block whose keys are all masked leaves the state as it was.
    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK)
    lo = tl.load(prefix_offsets + b)
    hi = tl.load(prefix_offsets + b + 1)
    for start in range(lo, hi, BLOCK):
        valid = start + n < hi
        slots = tl.load(prefix + start + n, mask=valid, other=0)
        m_i, l_i, acc = _attend(q, k_cache, v_cache, slots, valid, kv_head, stride_ks,
                                stride_kh, d, d_valid, m_i, l_i, acc, scale)
    if tl.load(causal + b) != 0:  # the chunk's tokens up to this one
        lo = tl.load(seq_offsets + b)
        hi = t + 1
        keys = slot_mapping
    else:  # the token's own list: its tree ancestors and itself
        lo = tl.load(local_offsets + t)
        hi = tl.load(local_offsets + t + 1)
        keys = local
    for start in range(lo, hi, BLOCK):
        valid = start + n < hi
        slots = tl.load(keys + start + n, mask=valid, other=0)
        m_i, l_i, acc = _attend(q, k_cache, v_cache, slots, valid, kv_head, stride_ks,
                                stride_kh, d, d_valid, m_i, l_i, acc, scale)
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & d_valid[None, :])


class TritonPagedAttention:
    """Drop-in for PagedAttention on CUDA: the same metadata, one kernel launch per layer."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D] -> out [T, H * D]
        p = meta.paged
        assert p is not None and p.token_seq is not None, "needs PagedMetadata with token_seq"
        k_cache, v_cache = cache.k[layer], cache.v[layer]  # [slots, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if num_tokens == 0:
            return out
        _paged_attention[(num_tokens, num_kv_heads)](
            q, k_cache, v_cache, out, meta.slot_mapping, p.token_seq, p.seq_offsets, p.prefix,
            p.prefix_offsets, p.local, p.local_offsets, p.causal, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), out.stride(0), head_dim ** -0.5,
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim), BLOCK=BLOCK_KEYS)
        return out
