"""engine/cuda_graphs.py on the CPU: a step padded into the static buffers of its bucket (what a CUDA
graph replays) gives the logits of the unpadded step, through the CPU attention kernel, which reads
the same metadata as the Triton kernel; bucketing; the pad slot; engine outputs unchanged. The
capture itself runs in tests/test_cuda.py on a GPU. Also bench speed's divergence report, which
runs the same tiny model."""

from __future__ import annotations

import random

import pytest
import torch
from attention_cases import forward_items
from conftest import repetitive_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec import LLM, SamplingParams
from ngramspec.engine.cuda_graphs import GraphLimits, StepGraphs
from ngramspec.engine.step_inputs import ForwardItem, flatten
from ngramspec.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs the CPU attention kernel")

LIMITS = GraphLimits(max_tokens=256, max_seqs=8, max_query=64, max_prefix=4096, max_local=4096)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(model=str(tiny_model_dirs["llama"]), device="cpu", dtype="float32")


def _static(llm: LLM, limits: GraphLimits = LIMITS) -> StepGraphs:
    r = llm.engine.runner
    return StepGraphs(r.model, r.cache, r.pad_slot, limits, r.device, capture=False)


def _items(seed: int, vocab: int) -> list[ForwardItem]:
    rng = random.Random(seed)
    items = forward_items(rng, 400)  # chunks, trees and a decode token on shuffled slots
    for it in items:
        it.token_ids = [rng.randrange(vocab) for _ in it.token_ids]
        it.logits_rows = sorted(rng.sample(range(len(it.token_ids)), min(3, len(it.token_ids))))
    return items


def test_padded_static_step_gives_the_unpadded_logits(llm):
    runner = llm.engine.runner
    graphs = _static(llm)
    for seed in range(3):
        items = _items(seed, runner.model_cfg.vocab_size)
        flat = flatten(items)
        assert graphs.bucket(flat) is not None  # 102 tokens -> the 128 bucket
        expected = runner.run(items)  # eager (this runner has no graphs)
        got = graphs.run(flat)
        assert got is not None and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_pad_tokens_write_only_the_pad_slot(llm):
    runner = llm.engine.runner
    assert runner.cache.k.shape[1] == runner.pad_slot + 1  # one row past the allocator's
    assert llm.engine.allocator.num_slots == runner.pad_slot
    items = _items(7, runner.model_cfg.vocab_size)[:3]  # 18 tokens -> padded to 24
    flat = flatten(items)
    touched = set(flat.slots) | {runner.pad_slot}
    runner.cache.k[:, runner.pad_slot] = 1234.0  # a value no K projection gives
    before_k = runner.cache.k.clone()
    assert _static(llm).run(flat) is not None
    changed = (runner.cache.k != before_k).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert set(changed) <= touched and runner.pad_slot in changed


def test_buckets_and_what_runs_eagerly(llm):
    graphs = _static(llm, GraphLimits(max_tokens=100, max_seqs=4, max_query=20, max_prefix=64,
                                      max_local=64))
    assert graphs.buckets[-1] == 100 and graphs.buckets[-2] == 96

    def step(*lengths: int, prefix: int = 0, tree: bool = False) -> list[ForwardItem]:
        out, slot = [], 1
        for n in lengths:
            mask = [[j <= i for j in range(n)] for i in range(n)] if tree else None
            out.append(ForwardItem([1] * n, list(range(prefix, prefix + n)),
                                   list(range(slot, slot + prefix)),
                                   list(range(slot + prefix, slot + prefix + n)), mask, [n - 1]))
            slot += prefix + n
        return out

    assert graphs.bucket(flatten(step(1))) == (1, 1)
    assert graphs.bucket(flatten(step(1, 1, 1))) == (4, 1)
    assert graphs.bucket(flatten(step(13, 1))) == (16, 1)
    assert graphs.bucket(flatten(step(17, 3))) == (24, 2)  # two query blocks of 16
    assert graphs.bucket(flatten(step(20, 20, 20, 20, 20))) is None  # 100 tokens, 5 sequences
    assert graphs.bucket(flatten(step(21))) is None  # longer than max_query
    assert graphs.bucket(flatten(step(2, 2, prefix=40))) is None  # 80 prefix slots
    assert graphs.bucket(flatten(step(9, 9, tree=True))) is None  # 90 visible-slot entries
    assert graphs.bucket(flatten(step(5, 5, tree=True))) == (12, 1)
    with pytest.raises(ValueError, match="max_seqs"):
        GraphLimits(max_tokens=8, max_seqs=0, max_query=8, max_prefix=8, max_local=8)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_engine_outputs_unchanged_on_static_inputs(tiny_model_dirs, speculative):
    """Whole requests (prefill chunks eager, decodes and trees through the static buffers) give
    the tokens of the eager engine."""
    options = dict(model=str(tiny_model_dirs["llama"]), device="cpu", dtype="float32",
                   speculative=speculative, verify_cost=[1.0] * 14, max_num_batched_tokens=96)
    prompts = repetitive_prompts(5, 500, length=20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = [o.token_ids for o in LLM(**options).generate(prompts, params)]
    llm = LLM(**options)
    runner = llm.engine.runner
    runner.graph_limits = GraphLimits.for_engine(96, 64, llm.engine.max_model_len)
    runner.graphs = runner._graphs()
    padded_steps = 0
    run = runner.graphs.run

    def counting(flat, *rest):
        nonlocal padded_steps
        out = run(flat, *rest)
        padded_steps += out is not None
        return out

    runner.graphs.run = counting
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    assert padded_steps >= 20
    if speculative:
        assert llm.engine.stats.num_accepted_tokens > 0


def test_divergence_gaps_are_the_plain_models_top2_gap(llm):
    """bench speed's report at a flip: the gap between plain's top two logits where the outputs
    part, computed without disturbing the engine's slots."""
    from ngramspec.bench.speed_bench import divergence_gaps

    prompt = [5, 9, 13, 17, 21, 25]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                  ignore_eos=True))[0].token_ids
    other = plain[:3] + [plain[3] + 1] + plain[4:]
    free = llm.engine.allocator.num_free
    gaps = divergence_gaps(llm, [prompt, prompt], [plain, plain], [plain, other])
    assert llm.engine.allocator.num_free == free
    n = len(prompt) + 3
    item = ForwardItem(prompt + plain[:3], list(range(n)), [], list(range(1, n + 1)), None,
                       [n - 1])
    top = llm.engine.runner.run([item])[0].topk(2).values
    assert len(gaps) == 1 and gaps[0] == pytest.approx(float(top[0] - top[1]), abs=1e-3)
    assert gaps[0] > 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=20), st.integers(0, 5))
def test_tree_as_parents_flattens_like_its_ancestor_mask(seeds, prefix):
    """ForwardItem.parents (what the engine sends) and the equivalent ancestor mask give the same
    per-token key lists and the same SDPA mask."""
    from ngramspec.drafting.tree import DraftTree

    parents = [-1] + [s % i for i, s in zip(range(1, len(seeds)), seeds[1:])]
    tree = DraftTree([1] * len(parents), parents, [1.0] * len(parents))
    slots = [100 + 3 * i for i in range(len(parents))]
    positions = list(range(prefix, prefix + len(parents)))
    by_mask = ForwardItem(tree.token_ids, positions, list(range(1, prefix + 1)), slots,
                          tree.ancestor_mask(), [0])
    by_parents = ForwardItem(tree.token_ids, positions, list(range(1, prefix + 1)), slots, None,
                             [0], parents=parents)
    assert by_parents.mask() == tree.ancestor_mask() and not by_parents.causal
    a, b = flatten([by_mask]), flatten([by_parents])
    assert a.local.tolist() == b.local.tolist() and a.causal == b.causal
    assert a.local_offsets.tolist() == b.local_offsets.tolist()
