"""KV cache: the slot allocator, and the engine under a small cache (waiting, preemption, no leaks,
no corruption)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    GREEDY,
    NUM_THREADS,
    PROMPTS,
    GreedyRef,
    LogitsProbe,
    assert_no_kv_leak,
    assert_same_tokens,
    top2_gap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec import LLM, SamplingParams
from ngramspec.engine.kv_cache import SlotAllocator, SlotList
from ngramspec.engine.model_runner import ForwardItem
from ngramspec.engine.sequence import Status
from ngramspec.layers.attention import KVCache

# ----------------------------------------------------------------------------- allocator

_slot_ops = st.lists(st.tuples(st.sampled_from(
    ["append", "iadd", "extend", "del_tail", "set", "set_slice", "del_step", "pop", "insert",
     "remove", "sort", "reverse", "clear", "imul", "read"]), st.integers(-30, 30)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 99), max_size=20), _slot_ops)
def test_slot_list_buffer_always_equals_the_list(start: list[int], ops) -> None:
    """SlotList.array() after any mix of list mutations is the list (the buffer is only ever
    re-read from where something changed)."""
    ours, ref = SlotList(start), list(start)
    for op, k in ops:
        n = len(ref)
        i = k % n if n else 0
        if op == "append":
            ours.append(k), ref.append(k)
        elif op == "iadd":
            ours += [k, k + 1]
            ref += [k, k + 1]
        elif op == "extend":
            ours.extend(range(abs(k) % 4)), ref.extend(range(abs(k) % 4))
        elif op == "del_tail" and n:
            del ours[-(i + 1):], ref[-(i + 1):]
        elif op == "set" and n:
            ours[i], ref[i] = k, k
        elif op == "set_slice":
            ours[i:i + 2], ref[i:i + 2] = [k] * 3, [k] * 3
        elif op == "del_step":
            del ours[i::2], ref[i::2]
        elif op == "pop" and n:
            assert ours.pop(k % n - n) == ref.pop(k % n - n)
        elif op == "insert":
            ours.insert(k, 7), ref.insert(k, 7)
        elif op == "remove" and n:
            ours.remove(ref[i]), ref.remove(ref[i])
        elif op in ("sort", "reverse", "clear"):
            getattr(ours, op)(), getattr(ref, op)()
        elif op == "imul":
            ours *= 2
            ref *= 2
        assert ours.array().tolist() == ref == list(ours)



def test_allocator_hands_out_each_slot_once_and_never_slot_0() -> None:
    alloc = SlotAllocator(10)
    assert alloc.num_usable == 9 and alloc.num_free == 9
    a = alloc.allocate(4)
    b = alloc.allocate(5)
    assert sorted(a + b) == list(range(1, 10))
    assert alloc.allocate(1) is None and alloc.allocate(0) == []
    alloc.free(a)
    assert alloc.allocate(5) is None and alloc.num_free == 4, "a failed allocate took slots"
    assert sorted(alloc.allocate(4)) == sorted(a)
    with pytest.raises(ValueError, match="at least 2 slots"):
        SlotAllocator(1)


@given(st.integers(2, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 40),
                                                st.randoms(use_true_random=False)), max_size=60))
def test_allocator_equals_a_sorted_free_set(num_slots: int, ops: list) -> None:
    """The free tail plus a heap of holes below it (kv_cache.py) hands out exactly what one
    sorted set of every free slot would: the n lowest, and nothing when fewer are free."""
    alloc = SlotAllocator(num_slots)
    free, held = set(range(1, num_slots)), []
    for is_free, n, rng in ops:
        if is_free and held:
            out = rng.sample(held, min(n, len(held)))
            alloc.free(out)
            free |= set(out)
            held = [h for h in held if h not in out]
        else:
            got = alloc.allocate(n)
            assert got == (sorted(free)[:n] if n <= len(free) else None)
            free -= set(got or ())
            held += got or []
        assert alloc.num_free == len(free)


def test_allocator_hands_out_the_lowest_free_slots() -> None:
    """Lowest-first is what keeps a lone sequence's K/V one range (read in place)."""
    alloc = SlotAllocator(20)
    a = alloc.allocate(10)
    assert a == list(range(1, 11))
    alloc.free([7, 3, 9])
    assert alloc.allocate(2) == [3, 7]
    assert alloc.allocate(3) == [9, 11, 12]
    rng = random.Random(0)
    held = set(range(1, 13)) - {7, 3, 9} | {3, 7, 9}
    for _ in range(200):
        if held and rng.random() < 0.5:
            out = rng.sample(sorted(held), rng.randint(1, len(held)))
            alloc.free(out)
            held -= set(out)
        else:
            n = rng.randint(0, alloc.num_free)
            got = alloc.allocate(n)
            free = sorted(set(range(1, 20)) - held)
            assert got == free[:n]
            held |= set(got)


def _tree_item(ids: list[int], prefix: list[int], slots: list[int]) -> ForwardItem:
    """`ids` after a cached prefix: a root, two children of it, and a grandchild of the first."""
    parents = [-1, 0, 0, 1]
    mask = [[j == i or j == parents[i] or (i == 3 and j == 0) for j in range(4)] for i in range(4)]
    start = len(prefix)
    depth = [0, 1, 1, 2]
    return ForwardItem(ids, [start + d for d in depth], prefix, slots, mask, list(range(4)))


def test_kv_read_in_place_equals_kv_gathered(llm, prompt_ids) -> None:
    """A lone sequence on one slot range (read as a view) gives the logits it gets on scattered
    slots (gathered), for a prefill chunk and for a tree verify."""
    engine = llm.engine
    prompt = prompt_ids[1][:40]
    tree = [prompt[-1], 11, 22, 33]
    n = len(prompt) - 1
    results = []
    with engine.scheduler.scratch_slots(3 * (n + 4)) as pool:
        for slots in (pool[: n + 4], pool[::3][: n + 4][::-1]):  # one range; holes, reversed
            prefill = ForwardItem(prompt[:-1], list(range(n)), [], slots[:n], None,
                                  list(range(n)))
            in_place = engine.runner._range_group(prefill, 0, True) is not None
            assert in_place == (slots == pool[: n + 4])
            logits = engine.runner.run([prefill])
            verify = engine.runner.run([_tree_item(tree, slots[:n], slots[n:])])
            results.append((logits, verify))
    (a_pre, a_tree), (b_pre, b_tree) = results
    torch.testing.assert_close(a_pre, b_pre, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a_tree, b_tree, atol=1e-4, rtol=1e-4)
    assert (a_tree[1] - a_tree[2]).abs().max() > 1e-3, "siblings saw the same keys: mask ignored"


def test_kv_cache_bytes_per_slot() -> None:
    assert KVCache.bytes_per_slot(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert KVCache.bytes_per_slot(2, 2, 16, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    cache = KVCache(2, 7, 2, 16, torch.float32, torch.device("cpu"))
    assert cache.k.shape == cache.v.shape == (2, 7, 2, 16)


# ----------------------------------------------------------------------------- engine, tiny model


def _tiny_llm(model_dir, usable_slots: int, **options) -> LLM:
    per_slot = KVCache.bytes_per_slot(2, 2, 16, torch.float32)  # the tiny llama's shape
    llm = LLM(str(model_dir), num_threads=NUM_THREADS, kv_cache_bytes=(usable_slots + 1) * per_slot,
              **options)
    assert llm.engine.allocator.num_usable == usable_slots
    return llm


def _workload(n: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))]
        seed = rng.randrange(1000) if i % 4 == 3 else None  # some seeded sampling too
        params = SamplingParams(temperature=0.9 if seed is not None else 0, seed=seed,
                                max_tokens=rng.randint(1, 12), ignore_eos=True)
        out.append((prompt, params))
    return out


def _run_checked(llm: LLM, workload) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Submit in waves between steps and check slot accounting after every step."""
    engine = llm.engine
    preempt, counts = engine.scheduler.preempt, {"preempted": 0, "waited": 0}

    def counting_preempt(seq) -> None:
        counts["preempted"] += 1
        preempt(seq)

    engine.scheduler.preempt = counting_preempt
    outputs: dict[str, list[int]] = {}
    ids = iter(range(len(workload)))
    try:
        while True:
            for i in [next(ids, None) for _ in range(8)]:
                if i is not None:
                    engine.add_request(f"w{i}", *workload[i])
            if not engine.has_unfinished():
                break
            for out in engine.step():
                outputs.setdefault(out.seq.request_id, []).extend(out.new_token_ids)
            running = engine.scheduler.running
            assert_no_kv_leak(engine)
            assert all(not seq.slots for seq in engine.scheduler.waiting)
            counts["waited"] += bool(running and engine.scheduler.waiting)
    finally:
        del engine.scheduler.preempt
    return outputs, counts


def test_thousands_of_requests_under_a_small_cache(tiny_model_dirs) -> None:
    workload = _workload(1500, vocab=512)
    free_llm = _tiny_llm(tiny_model_dirs["llama"], 8000, max_num_seqs=16)
    rec = LogitsProbe(free_llm.engine)
    reference, free_counts = _run_checked(free_llm, workload)
    rec.close()
    small = _tiny_llm(tiny_model_dirs["llama"], 100, max_num_seqs=16)
    outputs, counts = _run_checked(small, workload)
    assert_no_kv_leak(small.engine)
    assert free_counts["preempted"] == 0
    assert counts["preempted"] >= 20 and counts["waited"] >= 50, counts
    for i, (_, params) in enumerate(workload):
        rid = f"w{i}"
        assert len(outputs[rid]) == params.max_tokens
        ref = GreedyRef(reference[rid], [top2_gap(r) for r in rec.rows[rid]])
        if params.greedy:
            assert_same_tokens(outputs[rid], ref, f"request {i} under preemption")
        else:
            assert outputs[rid] == ref.tokens, f"seeded request {i} changed under preemption"


def test_new_requests_wait_while_the_cache_is_full(tiny_model_dirs) -> None:
    llm = _tiny_llm(tiny_model_dirs["llama"], 60)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a = engine.add_request("a", list(range(3, 33)), params)
    b = engine.add_request("b", list(range(40, 70)), params)
    engine.step()
    assert a.status is Status.RUNNING and b.status is Status.WAITING  # 30 + reserve > 30 free
    while a.status is Status.RUNNING:
        assert b.status is Status.WAITING
        engine.step()
    while engine.has_unfinished():
        engine.step()
    alone = [llm.generate(s.token_ids[: s.num_prompt_tokens], params)[0].token_ids for s in (a, b)]
    assert [a.output_ids, b.output_ids] == alone


def test_a_request_that_outgrows_the_whole_cache_ends_instead_of_hanging(tiny_model_dirs) -> None:
    llm = _tiny_llm(tiny_model_dirs["llama"], 40)
    engine = llm.engine
    seq = engine.add_request("long", list(range(3, 23)),
                             SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert seq.is_finished and seq.finish_reason == "length"
    assert seq.num_tokens <= engine.allocator.num_usable
    assert_no_kv_leak(engine)


# ----------------------------------------------------------------------------- engine, real model


def test_preemption_never_corrupts_running_requests(prompt_ids, greedy_alone) -> None:
    # The raw prompts are admitted together, then their growth (16 tokens each) overflows a cache
    # with 24 spare slots: requests wait, get preempted and recomputed (prefill in chunks of 16).
    chosen = [i for i, (kind, _) in enumerate(PROMPTS) if kind == "raw"]
    usable = sum(len(prompt_ids[i]) for i in chosen) + 24
    per_slot = KVCache.bytes_per_slot(30, 3, 64, torch.float32)
    llm = LLM(num_threads=NUM_THREADS, dtype="float32", kv_cache_bytes=(usable + 1) * per_slot,
              max_num_batched_tokens=16)
    preempt, count = llm.engine.scheduler.preempt, [0]
    llm.engine.scheduler.preempt = lambda seq: (count.__setitem__(0, count[0] + 1), preempt(seq))
    outs = llm.generate([prompt_ids[i] for i in chosen], GREEDY)
    assert count[0] > 0, "no preemption happened: the test proves nothing"
    for i, out in zip(chosen, outs):
        assert_same_tokens(out.token_ids, greedy_alone[i], f"prompt {i} with {usable} slots")
    assert_no_kv_leak(llm.engine)
