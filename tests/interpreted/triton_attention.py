"""The Triton paged attention kernel (the CUDA path) against the SDPA reference, run on the CPU by
Triton's interpreter, and the engine on it end to end on a tiny model.

tests/test_triton_attention.py runs this file in its own pytest process with TRITON_INTERPRET=1:
the flag must be set before the kernels are defined, and Triton's bindings print leak warnings
when their process exits.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_triton_attention.py (TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from ngramspec import LLM, SamplingParams  # noqa: E402
from ngramspec.engine.model_runner import ForwardItem, ModelRunner  # noqa: E402
from ngramspec.layers.attention import AttentionMetadata, KVCache, ReferenceAttention  # noqa: E402
from ngramspec.layers.triton_attention import BLOCK_KEYS, TritonPagedAttention  # noqa: E402

FLAT_COST = [1.0] * 14  # verify cost independent of size: always draft the full tree


def _tree_mask(parents: list[int]) -> list[list[bool]]:
    """Row i sees its ancestors and itself (parents[i] < i; -1 = the root)."""
    mask = []
    for i, parent in enumerate(parents):
        row = list(mask[parent]) if parent >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def _items(rng: random.Random, num_slots: int) -> list[ForwardItem]:
    """A causal prefill chunk after a prefix, a draft tree, a lone decode token, a first chunk
    with no prefix, and a tree longer than one key block."""
    free = list(range(num_slots))
    rng.shuffle(free)

    def item(prefix: int, n: int, tree: bool) -> ForwardItem:
        slots = [free.pop() for _ in range(prefix + n)]
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        return ForwardItem([1] * n, list(range(prefix, prefix + n)), slots[:prefix],
                           slots[prefix:], _tree_mask(parents) if tree else None, [n - 1])

    return [item(37, 5, False), item(70, 12, True), item(3, 1, False), item(0, 9, False),
            item(5, BLOCK_KEYS + 7, True)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [
    (9, 3, 64, torch.float32),  # SmolLM2's grouping
    (4, 4, 24, torch.float32),  # no grouping; a head size that is not a power of two
    (8, 2, 32, torch.bfloat16),
])
def test_kernel_matches_the_sdpa_reference(heads, kv_heads, head_dim, dtype):
    rng = random.Random(heads)
    torch.manual_seed(heads)
    num_slots = 256
    items = _items(rng, num_slots)
    num_tokens = sum(len(it.token_ids) for it in items)
    q = torch.randn(num_tokens, heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)
    caches = [KVCache(1, num_slots, kv_heads, head_dim, dtype, torch.device("cpu"))
              for _ in range(2)]
    caches[0].k.normal_()
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    slot_mapping = torch.tensor([s for it in items for s in it.slots])
    runner = object.__new__(ModelRunner)
    runner.device, runner._causal = torch.device("cpu"), {}
    ref_meta = AttentionMetadata(slot_mapping, runner._groups(items))
    expected = ReferenceAttention()(0, q, k, v, caches[0], ref_meta)
    paged_meta = AttentionMetadata(slot_mapping, [], ModelRunner._paged(items, runner.device))
    got = TritonPagedAttention()(0, q, k, v, caches[1], paged_meta)
    assert torch.equal(caches[0].k, caches[1].k)  # both wrote the new K/V to the same slots
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_engine_on_the_triton_kernel_decodes_like_sdpa(tiny_model_dirs):
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9], [20, 21, 22, 23] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "triton"):
        for spec in (None, "ngram"):
            llm = LLM(model=str(tiny_model_dirs["llama"]), num_threads=1, device="cpu",
                      attention_backend=backend, speculative=spec, verify_cost=FLAT_COST)
            assert llm.engine.runner.attention == backend
            outputs[backend, spec] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton", "ngram"] == outputs["triton", None] == outputs["sdpa", None]
    assert llm.engine.stats.num_accepted_tokens > 0  # trees were verified through the kernel


def test_triton_backend_errors_are_clear(monkeypatch):
    from ngramspec.engine.model_runner import _attention_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        _attention_backend("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="flash")
