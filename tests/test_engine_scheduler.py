"""Scheduler properties, driven without a model: budgets, FCFS, chunked prefill, preemption,
slot accounting."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.engine.kv_cache import SlotAllocator
from ngramspec.engine.scheduler import Schedule, Scheduler
from ngramspec.engine.sequence import Sequence, Status
from ngramspec.sampling_params import SamplingParams

RESERVE = 16


def _seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Sequence(i, f"r{i}", list(range(prompt_len)), prompt_len, params, eos_token_ids=())


def _apply(scheduler: Scheduler, schedule: Schedule, rng: random.Random | None = None,
           ) -> list[Sequence]:
    """What the engine does after the forward pass: cache the computed K/V, append tokens where
    the step reached the end, finish at max_tokens. With `rng`, decodes first reserve a chain of
    drafts, accept a random prefix of it and trim what lies past max_tokens, as the engine does."""
    finished = []
    for chunk in schedule.chunks:
        seq = chunk.seq
        if not chunk.samples:
            scheduler.commit(chunk)
            continue
        num_new = 1
        drafts = rng.randint(0, 6) if rng is not None and chunk in schedule.decodes else 0
        if drafts and scheduler.reserve_tree(chunk, drafts):
            accepted = rng.randint(0, drafts)  # a chain: node i's parent is node i - 1
            scheduler.commit(chunk, list(range(accepted + 1)))
            num_new += accepted
        else:
            scheduler.commit(chunk)
        room = seq.params.max_tokens - seq.num_output_tokens
        seq.token_ids += [7] * min(num_new, room)
        scheduler.trim(seq)
        if seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq)
            finished.append(seq)
    return finished


def _held(scheduler: Scheduler) -> list[int]:
    return [s for q in scheduler.running for s in q.slots]


def _check_step(scheduler: Scheduler, schedule: Schedule, alloc: SlotAllocator) -> None:
    assert sum(c.num_tokens for c in schedule.chunks) <= scheduler.max_num_batched_tokens
    assert schedule.spare_tokens == scheduler.max_num_batched_tokens - sum(
        c.num_tokens for c in schedule.chunks)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for c in schedule.decodes:
        assert c.num_tokens == 1 and c.start == c.seq.num_tokens - 1 and c.samples
    for c in schedule.prefills:
        assert c.start == c.seq.num_cached and c.start + c.num_tokens <= c.seq.num_tokens
    assert len({c.seq.seq_id for c in schedule.chunks}) == len(schedule.chunks)
    assert all(c.seq.status is Status.RUNNING for c in schedule.chunks)
    held = _held(scheduler) + [s for c in schedule.chunks for s in c.slots]
    assert all(not q.slots for q in scheduler.waiting), "a waiting request holds K/V"
    assert len(held) == len(set(held)) and 0 not in held, "a slot is used twice, or slot 0"
    assert len(held) + alloc.num_free == alloc.num_usable, "slots leaked"


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=25),
    num_slots=st.integers(80, 400), max_seqs=st.integers(1, 8), budget=st.integers(1, 48),
    arrivals=st.lists(st.integers(0, 3), min_size=25, max_size=25),
    seed=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_random_workloads_keep_every_invariant(requests, num_slots, max_seqs, budget,
                                               arrivals, seed) -> None:
    """seed=None: plain decoding; otherwise decodes also reserve, commit and trim draft trees."""
    rng = None if seed is None else random.Random(seed)
    scheduler = Scheduler(num_slots, max_seqs, budget, admission_reserve=RESERVE)
    alloc = scheduler.allocator
    # Like the engine's validation: a request must fit the cache on its own.
    pending = [_seq(i, p, min(m, alloc.num_usable - p)) for i, (p, m) in enumerate(requests)
               if p + 1 + RESERVE <= alloc.num_usable]
    arrived, admitted, done = 0, [], []
    for step in range(20_000):
        # Some steps see new arrivals; an idle scheduler always gets one.
        n = arrivals[step % len(arrivals)] or int(not scheduler.has_unfinished())
        for seq in pending[arrived : arrived + n]:
            scheduler.add(seq)
        arrived = min(arrived + n, len(pending))
        if not scheduler.has_unfinished():
            break
        schedule = scheduler.schedule()
        assert schedule, "requests are waiting but nothing was scheduled (livelock)"
        _check_step(scheduler, schedule, alloc)
        admitted += [c.seq.seq_id for c in schedule.prefills if c.seq.seq_id not in admitted]
        done += _apply(scheduler, schedule, rng)
        assert all(q.num_cached == q.num_tokens - 1 for q in scheduler.running
                   if q in [c.seq for c in schedule.decodes]), "a decode kept K/V past its tokens"
        assert len(_held(scheduler)) + alloc.num_free == alloc.num_usable, "slots leaked"
    assert len(done) == len(pending), "not every request finished"
    assert admitted == sorted(admitted), "a later request was admitted before an earlier one"
    assert all(q.num_output_tokens == q.params.max_tokens for q in done)
    assert alloc.num_free == alloc.num_usable


def test_decodes_first_then_fcfs_prefills_in_chunks() -> None:
    scheduler = Scheduler(1000, max_num_seqs=4, max_num_batched_tokens=10)
    a, b = _seq(0, 4, 5), _seq(1, 25, 5)
    scheduler.add(a)
    scheduler.add(b)
    s1 = scheduler.schedule()  # a's whole prompt, then 6 tokens of b's
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in s1.prefills] == [(0, 0, 4), (1, 0, 6)]
    _apply(scheduler, s1)
    s2 = scheduler.schedule()  # a decodes first; b continues with the rest of the budget
    assert [(c.seq.seq_id, c.start) for c in s2.decodes] == [(0, 4)]
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in s2.prefills] == [(1, 6, 9)]
    assert s2.spare_tokens == 0


def test_full_cache_makes_new_requests_wait() -> None:
    scheduler = Scheduler(1 + 40, max_num_seqs=8, max_num_batched_tokens=100, admission_reserve=4)
    a, b = _seq(0, 20, 10), _seq(1, 20, 3)
    scheduler.add(a)
    scheduler.add(b)
    _apply(scheduler, scheduler.schedule())
    assert a.status is Status.RUNNING and b.status is Status.WAITING  # 20 + 4 > 20 free
    while a.status is not Status.FINISHED:
        schedule = scheduler.schedule()
        assert b not in [c.seq for c in schedule.chunks]
        _apply(scheduler, schedule)
    assert scheduler.schedule().prefills[0].seq is b


def test_preemption_takes_the_latest_arrival_and_requeues_it_first() -> None:
    scheduler = Scheduler(1 + 24, max_num_seqs=8, max_num_batched_tokens=100, admission_reserve=0)
    a, b, c = _seq(0, 10, 20), _seq(1, 10, 20), _seq(2, 30, 1)
    for q in (a, b, c):
        scheduler.add(q)
    _apply(scheduler, scheduler.schedule())  # a and b prefilled: 20 of 24 slots
    assert [q.seq_id for q in scheduler.running] == [0, 1] and list(scheduler.waiting) == [c]
    for _ in range(2):  # both decode: 22, then 24 slots used
        _apply(scheduler, scheduler.schedule())
    schedule = scheduler.schedule()  # a needs a slot: b (later arrival) is preempted
    assert [ch.seq for ch in schedule.decodes] == [a]
    assert b.status is Status.WAITING and not b.slots and list(scheduler.waiting) == [b, c]
    assert b.num_output_tokens == 3  # its tokens survive; only its K/V is recomputed
