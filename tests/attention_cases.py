"""The Triton attention kernel against the SDPA reference on mixed batches (prefill chunks, trees,
decodes): shared by the interpreter check on the CPU and tests/test_cuda.py on a GPU."""

from __future__ import annotations

import random

import torch

from ngramspec.engine.model_runner import ForwardItem, ModelRunner, paged_metadata
from ngramspec.engine.step_inputs import flatten
from ngramspec.layers.attention import AttentionMetadata, KVCache, ReferenceAttention

# (query heads, KV heads, head size, dtype): SmolLM2's grouping; no grouping with a head size that
# is not a power of two; a bf16 cache
CASES = [(9, 3, 64, torch.float32), (4, 4, 24, torch.float32), (8, 2, 32, torch.bfloat16)]


def tree_mask(parents: list[int]) -> list[list[bool]]:
    """Row i sees its ancestors and itself (parents[i] < i; -1 = the root)."""
    mask: list[list[bool]] = []
    for i, parent in enumerate(parents):
        row = list(mask[parent]) if parent >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def forward_items(rng: random.Random, num_slots: int) -> list[ForwardItem]:
    """A causal chunk after a prefix, a draft tree, a lone decode token, a first chunk with no
    prefix, a tree and a chunk longer than the kernel's blocks, on shuffled slots."""
    free = list(range(num_slots))
    rng.shuffle(free)

    def item(prefix: int, n: int, tree: bool) -> ForwardItem:
        slots = [free.pop() for _ in range(prefix + n)]
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        return ForwardItem([1] * n, list(range(prefix, prefix + n)), slots[:prefix],
                           slots[prefix:], tree_mask(parents) if tree else None, [n - 1])

    return [item(37, 5, False), item(70, 12, True), item(3, 1, False), item(0, 9, False),
            item(5, 40, True), item(81, 35, False)]


def check_against_sdpa(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device) -> None:
    from ngramspec.layers.triton_attention import TritonPagedAttention

    rng = random.Random(heads)
    gen = torch.Generator().manual_seed(heads)
    num_slots = 512
    items = forward_items(rng, num_slots)
    num_tokens = sum(len(it.token_ids) for it in items)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = randn(num_tokens, heads, head_dim), randn(num_tokens, kv_heads, head_dim), \
        randn(num_tokens, kv_heads, head_dim)
    caches = [KVCache(1, num_slots, kv_heads, head_dim, dtype, device) for _ in range(2)]
    for cache in caches:
        cache.k.copy_(randn(1, num_slots, kv_heads, head_dim))
        cache.v.copy_(randn(1, num_slots, kv_heads, head_dim))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    slot_mapping = torch.tensor([s for it in items for s in it.slots], device=device)
    runner = object.__new__(ModelRunner)
    runner.device, runner._causal = device, {}
    expected = ReferenceAttention()(0, q, k, v, caches[0],
                                    AttentionMetadata(slot_mapping, runner._groups(items)))
    meta = AttentionMetadata(slot_mapping, [], paged_metadata(flatten(items), device))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in (None, 1, 4):  # the batch's own choice, one program per row, a split prefix
        got = TritonPagedAttention(splits)(0, q, k, v, caches[1], meta)
        assert torch.equal(caches[0].k, caches[1].k)  # both wrote the new K/V to the same slots
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
