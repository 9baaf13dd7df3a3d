"""The in-place CPU attention kernel against a float64 brute-force reference, and its batch
invariance (a token's output is bitwise the same alone or among other query tokens)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.layers.attention import AttentionMetadata, KVCache, PagedAttention, PagedMetadata

H, KVH = 6, 2


def _case(rng: random.Random, num_seqs: int, dim: int, dtype: torch.dtype, max_prefix: int = 40):
    """Random sequences: each a cached prefix and 1-9 query tokens under a random tree mask.
    Prefixes past 256 keys span several of the kernel's key chunks."""
    slots = num_seqs * (max_prefix + 10) + 1
    cache = KVCache(1, slots, KVH, dim, dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    free = list(range(1, slots))
    rng.shuffle(free)
    seqs = []
    for _ in range(num_seqs):
        prefix = [free.pop() for _ in range(rng.randint(0, max_prefix))]
        n = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        visible = []
        for i in range(n):  # ancestors and self, in index (= position) order
            chain, j = [], i
            while j >= 0:
                chain.append(j)
                j = parents[j]
            visible.append(sorted(chain))
        seqs.append((prefix, [free.pop() for _ in range(n)], visible))
    return cache, seqs


def _metadata(seqs, causal: bool = False) -> tuple[torch.Tensor, PagedMetadata]:
    slot_mapping, seq_off, prefix, prefix_off, local, local_off = [], [0], [], [0], [], [0]
    for pre, slots, visible in seqs:
        slot_mapping += slots
        seq_off.append(seq_off[-1] + len(slots))
        prefix += pre
        prefix_off.append(len(prefix))
        for cols in visible:
            local += [slots[c] for c in cols]
            local_off.append(len(local))
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    flags = t([int(causal)] * len(seqs))
    return t(slot_mapping), PagedMetadata(t(seq_off), t(prefix), t(prefix_off), t(local),
                                          t(local_off), flags,
                                          max((len(s) for _, s, _ in seqs), default=1))


def _run(cache, seqs, q, k, v, causal: bool = False):
    slot_mapping, paged = _metadata(seqs, causal)
    meta = AttentionMetadata(slot_mapping, [], paged)
    return PagedAttention()(0, q, k, v, cache, meta)


def _reference(cache, seqs, q) -> torch.Tensor:
    """Softmax attention in float64 over each token's key list (after the step's K/V writes)."""
    k, v = cache.k[0].double(), cache.v[0].double()
    rows = []
    t = 0
    for pre, slots, visible in seqs:
        for cols in visible:
            keys = torch.tensor(pre + [slots[c] for c in cols], dtype=torch.long)
            out = []
            for h in range(H):
                g = h // (H // KVH)
                s = (k[keys, g] @ q[t, h].double()) * q.shape[-1] ** -0.5
                out.append(torch.softmax(s, 0) @ v[keys, g])
            rows.append(torch.cat(out))
            t += 1
    return torch.stack(rows)


@pytest.mark.parametrize("dim", [64, 24, 16])  # 24: the scalar path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_prefix", [40, 700])
def test_matches_brute_force_softmax(dim, dtype, max_prefix):
    rng = random.Random(dim + max_prefix)
    cache, seqs = _case(rng, 5, dim, dtype, max_prefix)
    n = sum(len(s[1]) for s in seqs)
    q, k, v = (torch.randn(n, heads, dim).to(dtype) for heads in (H, KVH, KVH))
    out = _run(cache, seqs, q, k, v)
    # the step's own K/V went into the cache at its slots before attending
    assert torch.equal(cache.k[0][[s for _, slots, _ in seqs for s in slots]], k)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference(cache, seqs, q), rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from([40, 600]), st.sampled_from([64, 24]))
def test_a_token_alone_equals_the_token_in_a_batch(seed, dtype, max_prefix, dim):
    """Token i of a tree, run with its ancestors' K/V already cached as its prefix (what plain
    decoding does later), gives bitwise the output it got inside the tree."""
    rng = random.Random(seed)
    cache, seqs = _case(rng, 3, dim, dtype, max_prefix)
    n = sum(len(s[1]) for s in seqs)
    q, k, v = (torch.randn(n, heads, dim).to(dtype) for heads in (H, KVH, KVH))
    batch = _run(cache, seqs, q, k, v)
    t = 0
    for pre, slots, visible in seqs:
        for i, cols in enumerate(visible):
            alone = [(pre + [slots[c] for c in cols[:-1]], [slots[i]], [[0]])]
            out = _run(cache, alone, q[t : t + 1], k[t : t + 1], v[t : t + 1])
            assert torch.equal(out[0], batch[t]), (seed, t)
            t += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_causal_chunk_shares_its_keys_without_changing_a_bit(dtype):
    """A 600-token prefill chunk after a 300-token prefix: marked causal, its tokens share key
    chunks; the outputs match the brute force and are bitwise those of the unshared run."""
    rng = random.Random(7)
    cache = KVCache(1, 1000, KVH, 64, dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    free = list(range(1, 1000))
    rng.shuffle(free)
    prefix, slots = free[:300], free[300:900]
    seqs = [(prefix, slots, [list(range(i + 1)) for i in range(600)])]
    q, k, v = (torch.randn(600, heads, 64).to(dtype) for heads in (H, KVH, KVH))
    shared = _run(cache, seqs, q, k, v, causal=True)
    alone = _run(cache, seqs, q, k, v, causal=False)
    assert torch.equal(shared, alone)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(shared.double(), _reference(cache, seqs, q), rtol=tol, atol=tol)
