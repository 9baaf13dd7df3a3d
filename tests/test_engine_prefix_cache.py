"""Prefix caching without a model: the trie's locking and LRU eviction, and the scheduler driven
through thousands of random requests with shared prefixes, drafts, aborts and preemption, with
a fake K/V store that records which token prefix each slot was computed for."""

from __future__ import annotations

import random

import pytest
from conftest import NUM_THREADS
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec import LLM
from ngramspec.engine.prefix_cache import PrefixCache
from ngramspec.engine.scheduler import Scheduler
from ngramspec.engine.sequence import Sequence, Status
from ngramspec.sampling_params import SamplingParams


def test_match_insert_lock_and_lru_eviction() -> None:
    cache = PrefixCache()
    node, slots = cache.match([1, 2, 3])
    assert slots == [] and node is cache.root
    a, taken = cache.insert(node, [1, 2, 3], [11, 12, 13])
    assert taken == 3 and cache.num_nodes == 3 and cache.num_evictable == 0
    assert cache.evict(10) == []  # locked
    cache.unlock(a)
    b_node, b_slots = cache.match([1, 2, 9, 9])
    assert b_slots == [11, 12]
    b, taken = cache.insert(b_node, [9], [21])
    assert taken == 1 and cache.num_evictable == 1  # 13 (a's leaf) only
    # another computation of [1, 2, 9] in other slots is not taken: its owner keeps them
    end, taken = cache.insert(cache.root, [1, 2, 9], [31, 32, 33])
    assert taken == 0 and end is cache.root and cache.num_nodes == 4
    cache.unlock(b)
    assert cache.num_evictable == 4
    assert cache.evict(1) == [13]  # least recently used leaf first
    assert sorted(cache.evict(10)) == [11, 12, 21]  # parents follow once they are leaves
    assert cache.num_nodes == 0 and cache.num_evictable == 0


def _seq(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Sequence(i, f"r{i}", list(prompt), len(prompt), params, eos_token_ids=())


class FakeKV:
    """slot -> the token prefix whose last token's K/V it holds (what a forward pass writes)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[int, ...]] = {}

    def write(self, seq: Sequence, start: int, slots: list[int]) -> None:
        for k, slot in enumerate(slots):
            self.kv[slot] = tuple(seq.token_ids[: start + k + 1])

    def check(self, seq: Sequence) -> None:
        for j, slot in enumerate(seq.slots):
            assert self.kv.get(slot) == tuple(seq.token_ids[: j + 1]), \
                f"{seq.request_id}: slot {slot} at position {j} holds another prefix's K/V"


def _step(scheduler: Scheduler, kv: FakeKV, rng: random.Random, chaos: bool = True
          ) -> list[Sequence]:
    """The engine's part of a step: compute, verify a random chain of drafts, append random
    tokens (from a small alphabet, so outputs repeat), finish or abort some."""
    schedule = scheduler.schedule()
    assert schedule or not scheduler.has_unfinished()
    ended = []
    for chunk in schedule.chunks:
        seq = chunk.seq
        kv.write(seq, chunk.start, chunk.slots)
        if not chunk.samples:
            scheduler.commit(chunk)
            continue
        new = [rng.randrange(3)]
        drafts = rng.randint(0, 4) if chaos and chunk in schedule.decodes else 0
        if drafts and scheduler.reserve_tree(chunk, drafts):
            accepted = rng.randint(0, drafts)
            draft_tokens = [rng.randrange(3) for _ in range(drafts)]
            seq.token_ids += draft_tokens[:accepted]  # what the tree wrote, for the fake KV
            kv.write(seq, chunk.start, chunk.slots[: accepted + 1])
            del seq.token_ids[len(seq.token_ids) - accepted:]
            scheduler.commit(chunk, list(range(accepted + 1)))
            new = draft_tokens[:accepted] + new
        else:
            scheduler.commit(chunk)
        room = seq.params.max_tokens - seq.num_output_tokens
        seq.token_ids += new[:room]
        scheduler.trim(seq)
        if seq.num_output_tokens >= seq.params.max_tokens or (chaos and rng.random() < 0.03):
            scheduler.finish(seq, reusable=rng.random() < 0.9)  # some end with an error
            ended.append(seq)
    return ended


def _check(scheduler: Scheduler, kv: FakeKV) -> None:
    cache, alloc = scheduler.cache, scheduler.allocator
    assert cache is not None
    cached = cache.slots()
    assert len(cached) == len(set(cached)) == cache.num_nodes
    own = [s for q in scheduler.running for s in q.slots[q.num_shared:]]
    assert len(own) == len(set(own)) and not set(own) & set(cached)
    for q in scheduler.running:
        assert set(q.slots[: q.num_shared]) <= set(cached)
        kv.check(q)
    assert all(not q.slots for q in scheduler.waiting), "a waiting request holds K/V"
    assert len(own) + len(cached) + alloc.num_free == alloc.num_usable, "slots leaked"
    assert 0 <= cache.num_evictable <= cache.num_nodes


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), num_slots=st.integers(60, 400), budget=st.integers(4, 64),
       max_seqs=st.integers(1, 8))
def test_thousands_of_requests_share_prefixes_and_leak_nothing(seed, num_slots, budget,
                                                               max_seqs) -> None:
    rng = random.Random(seed)
    scheduler = Scheduler(num_slots, max_seqs, budget, admission_reserve=4, prefix_cache=True)
    kv = FakeKV()
    systems = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    finished = 0
    for i in range(300 if num_slots > 100 else 120):
        prompt = rng.choice(systems) + [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        if len(prompt) + 1 + 4 <= scheduler.allocator.num_usable:
            scheduler.add(_seq(i, prompt, rng.randint(1, 12)))
        for _ in range(rng.randint(0, 3)):
            finished += len(_step(scheduler, kv, rng))
            _check(scheduler, kv)
    while scheduler.has_unfinished():
        finished += len(_step(scheduler, kv, rng))
        _check(scheduler, kv)
    cache = scheduler.cache
    assert cache.num_evictable == cache.num_nodes  # nothing running: all of it evictable
    assert cache.hits > 0, "no prefix was ever reused"
    held = cache.num_nodes
    assert scheduler.flush_cache() == held and cache.num_nodes == 0
    assert scheduler.allocator.num_free == scheduler.allocator.num_usable


def test_preempted_request_restarts_from_its_own_cached_tokens() -> None:
    """b is preempted to let a decode; its K/V go to the cache (used last, evicted last) and
    what a does not need back is reused when b resumes."""
    scheduler = Scheduler(1 + 30, max_num_seqs=8, max_num_batched_tokens=100,
                          admission_reserve=0, prefix_cache=True)
    kv, rng = FakeKV(), random.Random(0)
    a, b = _seq(0, list(range(10)), 14), _seq(1, list(range(100, 110)), 8)
    for q in (a, b):
        scheduler.add(q)
    preempted_at = None
    while not a.is_finished:
        _step(scheduler, kv, rng, chaos=False)
        _check(scheduler, kv)
        if b.status is Status.WAITING and preempted_at is None:
            preempted_at = b.num_output_tokens
    assert preempted_at, "the test needs b preempted after it produced tokens"
    hits = scheduler.cache.hits
    while not b.is_finished:
        _step(scheduler, kv, rng, chaos=False)
        _check(scheduler, kv)
    assert scheduler.cache.hits > hits + 5  # most of b's prompt came back from the cache


# ---- with the model: cache on == cache off -------------------------------------------------------

SYSTEM = ("You are a careful assistant for a shipping company. Answer in at most two sentences, "
          "quote order numbers exactly, and never invent tracking details.")
QUESTIONS = ["Where is order 4417?", "Can I change the address of order 981?",
             "What does 'in transit' mean?"]


def _conversations(llm, params, turns: int = 3) -> list[list[int]]:
    """Multi-turn chats on a shared system prompt: each turn resends the whole conversation."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in QUESTIONS]
    tokens = []
    for turn in range(turns):
        outs = llm.chat(chats, params)
        for chat, out in zip(chats, outs):
            tokens.append(out.token_ids)
            chat += [{"role": "assistant", "content": out.text},
                     {"role": "user", "content": f"Thanks. And follow-up number {turn + 1}?"}]
    return tokens


@pytest.mark.model
def test_prefix_cache_changes_no_token() -> None:
    """Multi-turn chats on a shared system prompt, greedy, speculation off and on: the same
    tokens as with the cache off, with most prompt tokens served from the cache."""
    params = SamplingParams(temperature=0, max_tokens=40)
    off = LLM(num_threads=NUM_THREADS, dtype="float32", enable_prefix_caching=False)
    reference = _conversations(off, params)
    for speculative in (None, "ngram"):
        on = LLM(num_threads=NUM_THREADS, dtype="float32", speculative=speculative,
                 verify_cost=[1.0] * 14 if speculative else None)
        assert _conversations(on, params) == reference, f"speculative={speculative}"
        cache = on.engine.scheduler.cache
        assert cache.hits > 0.5 * cache.queries, (cache.hits, cache.queries)
        prefilled = on.engine.stats.num_prefill_tokens
        assert prefilled < 0.5 * off.engine.stats.num_prefill_tokens, "the cache saved little"
        alloc = on.engine.allocator
        assert alloc.num_free + cache.num_nodes == alloc.num_usable
        assert cache.num_evictable == cache.num_nodes
    assert off.engine.scheduler.cache is None
