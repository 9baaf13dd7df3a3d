"""Attention over the paged KV cache in one Triton kernel (the CUDA path).

It reads the same `PagedMetadata` as the CPU kernel (layers/attention.py): every query token sees its
sequence's cached prefix, then its own visible query-token slots (its tree ancestors and itself,
or the causal run of its chunk). One program per (sequence, KV head, block of 16 of its query
tokens) computes all of their rows (token x the group's query heads) together, so each key block
is loaded once for the whole tree or chunk block, with an online softmax over blocks of 32 keys:
K/V read in place by slot, no padding, no gather copy, no [queries x keys] mask built per sequence.
A tree row's visible query tokens are matched by slot against its own list (tree depth
comparisons per key block). When the batch has too few (sequence, KV head) pairs to fill the GPU
(one request decoding: 3 programs on 132 multiprocessors), each sequence's cached prefix is split
into shares read by programs of their own, and a second kernel merges their partial softmaxes
(flash-decoding); the split count depends only on the batch's shape, so CUDA graphs capture it. Everything is float32: products are TF32 tensor-core dots in bf16 mode
(bf16 values are exact in TF32; the softmax weights are rounded to TF32) and full-precision ones
when the queries or the cache are float32.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how
tests/test_triton_attention.py checks it against the SDPA reference on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ngramspec.layers.attention import AttentionMetadata, KVCache

BLOCK_QUERIES = 16  # query tokens of one sequence per program: they share every key load
BLOCK_KEYS = 32


@triton.jit
def _attend(q, k_cache, v_cache, slots, visible, kv_head, stride_ks, stride_kh, d, d_valid,
            m_i, l_i, acc, scale, PRECISE: tl.constexpr):
    """Fold one block of keys into the running softmax of every (query token, head) row."""
    key_valid = tl.max(visible.to(tl.int32), axis=0) > 0  # [N]: some row sees the key
    kv_mask = key_valid[:, None] & d_valid[None, :]
    at = slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    k = tl.load(k_cache + at, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
    v = tl.load(v_cache + at, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
    # bf16 queries and keys are exact in TF32, so TF32 tensor cores lose nothing on q.k (p.v
    # rounds p to TF32's 10-bit mantissa, finer than bf16); float32 gets full-precision products.
    if PRECISE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision="tf32")
    s = tl.where(visible, s * scale, float("-inf"))  # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])  # [M, N]
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PRECISE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision="tf32")
    acc = acc * alpha[:, None] + pv  # [M, D]
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["splits"])
def _paged_attention(q_ptr, k_cache, v_cache, out_ptr, part_ptr, stats_ptr, slot_mapping,
                     seq_offsets, prefix, prefix_offsets, local, local_offsets, causal,
                     stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, scale, splits,
                     NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISE: tl.constexpr):
    # `splits` is a run-time value (one compiled kernel for every split count); SPLIT says
    # whether it is above 1, i.e. whether rows leave as partials for _merge_splits
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) % splits  # which share of the cached prefix this program reads
    first = (tl.program_id(2) // splits) * BLOCK_Q  # this block's first query token
    start_tok = tl.load(seq_offsets + b)
    num_q = tl.load(seq_offsets + b + 1) - start_tok
    if first < num_q:
        # Rows are (query token, head of the group) pairs: M = BLOCK_Q * GROUP_PAD.
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        qi = first + r // GROUP_PAD
        g = r % GROUP_PAD
        row_valid = (qi < num_q) & (g < GROUP)
        tok = start_tok + qi
        d = tl.arange(0, DIM_PAD)
        d_valid = d < HEAD_DIM
        head = kv_head * GROUP + g
        q_mask = row_valid[:, None] & d_valid[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=q_mask, other=0.0).to(tl.float32)  # [M, D]
        # Finite start: a block with no key visible to a row leaves that row as it was.
        m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        start = tl.load(prefix_offsets + b)
        end = tl.load(prefix_offsets + b + 1)
        # the prefix in `splits` shares of whole key blocks; the last share also takes the query
        # tokens
        share = tl.cdiv(tl.cdiv(end - start, splits), BLOCK_N) * BLOCK_N
        lo = start + split * share
        hi = tl.minimum(lo + share, end)
        for at in range(lo, hi, BLOCK_N):  # the cached prefix: every row sees all of it
            key_valid = at + n < hi
            slots = tl.load(prefix + at + n, mask=key_valid, other=0)
            visible = row_valid[:, None] & key_valid[None, :]
            m_i, l_i, acc = _attend(q, k_cache, v_cache, slots, visible, kv_head, stride_ks,
                                    stride_kh, d, d_valid, m_i, l_i, acc, scale, PRECISE)
        # The sequence's query tokens: the causal run up to each row's token, or the row's own
        # list (tree ancestors and itself) matched by slot.
        is_causal = tl.load(causal + b) != 0
        own_lo = tl.load(local_offsets + tok, mask=row_valid, other=0)
        own_len = tl.load(local_offsets + tok + 1, mask=row_valid, other=0) - own_lo
        longest = tl.max(own_len, axis=0)
        last = tl.minimum(num_q, first + BLOCK_Q)  # no row of this block sees a later token
        last = tl.where(split == splits - 1, last, 0)
        for at in range(0, last, BLOCK_N):
            j = at + n
            key_valid = j < last
            slots = tl.load(slot_mapping + start_tok + j, mask=key_valid, other=0)
            if is_causal:
                visible = j[None, :] <= qi[:, None]
            else:
                visible = (qi[:, None] < 0) & (j[None, :] < 0)  # all False, [M, N]
                for k in range(longest):
                    seen = tl.load(local + own_lo + k, mask=row_valid & (k < own_len), other=-1)
                    visible = visible | (seen[:, None] == slots[None, :])
            visible = visible & row_valid[:, None] & key_valid[None, :]
            m_i, l_i, acc = _attend(q, k_cache, v_cache, slots, visible, kv_head, stride_ks,
                                    stride_kh, d, d_valid, m_i, l_i, acc, scale, PRECISE)
        if SPLIT:  # unnormalised partials, [T, H, splits, D], and (max, sum), [T, H, splits, 2]
            row = (tok * NUM_HEADS + head) * splits + split
            tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
            tl.store(stats_ptr + row * 2, m_i, mask=row_valid)
            tl.store(stats_ptr + row * 2 + 1, l_i, mask=row_valid)
        else:
            out = acc / l_i[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits(part_ptr, stats_ptr, out_ptr, stride_ot, splits, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MAX_S: tl.constexpr):
    """One (token, head) row: its `splits` partial softmaxes rescaled to the largest maximum and
    summed, in split order."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DIM_PAD)
    d_valid = d < HEAD_DIM
    s = tl.arange(0, MAX_S)
    s_valid = s < splits
    row = (t * NUM_HEADS + h) * splits + s  # [MAX_S]
    m = tl.load(stats_ptr + row * 2, mask=s_valid, other=-1e30)
    l = tl.load(stats_ptr + row * 2 + 1, mask=s_valid, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.exp(m - top)  # a split that saw no key has l = 0 and contributes nothing
    acc = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [MAX_S, D]
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty),
             mask=d_valid)


def prefix_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Shares of each cached prefix read by programs of their own (flash-decoding): enough
    programs to cover the GPU's multiprocessors twice when the batch alone does not, else 1.
    A power of two from 1 to MAX_SPLITS; it depends on the batch's shape only, so a CUDA graph
    captures it, and it is a run-time kernel argument, so no split count compiles a kernel."""
    want = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(want)) if want > 1 else 1


MAX_SPLITS = 16


class TritonPagedAttention:
    """Drop-in for PagedAttention on CUDA: the same metadata, one kernel launch per layer (two
    when the prefix is split across programs: the partial softmaxes are then merged)."""

    def __init__(self, splits: int | None = None) -> None:
        """`splits`: prefix shares per sequence; None = `prefix_splits` for each batch."""
        if splits is not None and not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits={splits}: the merge kernel takes 1 to {MAX_SPLITS}")
        self.splits = splits
        self._num_sms: int | None = None

    def _splits(self, num_seqs: int, num_kv_heads: int, max_query_len: int,
                device: torch.device) -> int:
        if self.splits is not None:
            return self.splits
        if max_query_len > BLOCK_QUERIES:  # prefill chunks: their query blocks fill the GPU
            return 1
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 4)
        return prefix_splits(num_seqs, num_kv_heads, self._num_sms)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D] -> out [T, H * D]
        p = meta.paged
        assert p is not None, "TritonPagedAttention needs AttentionMetadata.paged"
        k_cache, v_cache = cache.k[layer], cache.v[layer]  # [slots, KVH, D]
        cache.write(layer, meta.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if num_tokens == 0:
            return out
        assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
        num_seqs = p.seq_offsets.shape[0] - 1
        splits = self._splits(num_seqs, num_kv_heads, p.max_query_len, q.device)
        dim_pad = max(16, triton.next_power_of_2(head_dim))
        part = stats = out  # unused when splits == 1
        if splits > 1:
            part = q.new_empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32)
            stats = q.new_empty(num_tokens, num_heads, splits, 2, dtype=torch.float32)
        grid = (num_seqs, num_kv_heads, triton.cdiv(p.max_query_len, BLOCK_QUERIES) * splits)
        _paged_attention[grid](
            q, k_cache, v_cache, out, part, stats, meta.slot_mapping, p.seq_offsets, p.prefix,
            p.prefix_offsets, p.local, p.local_offsets, p.causal, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), out.stride(0), head_dim ** -0.5, splits,
            NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_Q=BLOCK_QUERIES, BLOCK_N=BLOCK_KEYS,
            SPLIT=splits > 1, PRECISE=torch.float32 in (q.dtype, k_cache.dtype))
        if splits > 1:
            # rows of tokens that belong to no sequence (a graph's padding) merge garbage,
            # which nothing reads
            _merge_splits[(num_tokens, num_heads)](
                part, stats, out, out.stride(0), splits, NUM_HEADS=num_heads,
                HEAD_DIM=head_dim, DIM_PAD=dim_pad, MAX_S=MAX_SPLITS)
        return out
