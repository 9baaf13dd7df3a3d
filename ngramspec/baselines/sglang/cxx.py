"""The two libstdc++ containers whose iteration/tie order leaks into SGLang's draft trees.

SGLang numbers tree nodes by iterating `std::unordered_map<int32_t, int32_t>` and expands PROB
trees from a `std::priority_queue` that compares probabilities only. Both orders are
implementation-defined, and SGLang's golden tests depend on them, so the faithful preset replays
libstdc++'s exact algorithms (GCC >= 9: `_Prime_rehash_policy`, `_M_insert_bucket_begin`,
`_M_rehash_aux`, `__push_heap`/`__adjust_heap`) instead of guessing "reverse insertion order".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# libstdc++ `_Prime_rehash_policy::_M_next_bkt` fast table for n < 14 and the start of
# `__prime_list` (hashtable-aux.cc). Draft trees never hold more children than this covers.
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (
    2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89,
    97, 103, 109, 113, 127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293,
    313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031,
    1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209,
    3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273,
    11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447,
)
_BEFORE_BEGIN = None  # the list head sentinel (`_M_before_begin`)


def _bucket_of(key: int, num_buckets: int) -> int:
    # std::hash<int32_t> is the identity; the cast to size_t sign-extends negatives.
    return (key & 0xFFFFFFFFFFFFFFFF) % num_buckets


class CxxIntMap:
    """`std::unordered_map<int32_t, int32_t>` with libstdc++'s iteration order.

    Nodes form one singly linked list; a new key goes to the front of the list if its bucket
    is empty, else right after its bucket's predecessor node. Rehashing re-threads the list.
    """

    __slots__ = ("_values", "_next", "_buckets", "_num_buckets", "_next_resize")

    def __init__(self) -> None:
        self._values: dict[int, int] = {}
        self._next: dict[int | None, int | None] = {_BEFORE_BEGIN: None}
        self._buckets: dict[int, int | None] = {}  # bucket -> node before its first node
        self._num_buckets = 1
        self._next_resize = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: int) -> int | None:
        return self._values.get(key)

    def insert(self, key: int, value: int) -> None:
        """Insert a key that is not present yet (`insert`/`operator[]` on a miss)."""
        assert key not in self._values
        new_buckets = self._need_rehash(len(self._values) + 1)
        if new_buckets:
            self._rehash(new_buckets)
        self._insert_bucket_begin(_bucket_of(key, self._num_buckets), key)
        self._values[key] = value

    def items(self) -> Iterator[tuple[int, int]]:
        node = self._next[_BEFORE_BEGIN]
        while node is not None:
            yield node, self._values[node]
            node = self._next[node]

    def _next_bucket_count(self, n: int) -> int:
        if n < len(_FAST_BUCKETS):
            self._next_resize = _FAST_BUCKETS[n]
            return _FAST_BUCKETS[n]
        i = bisect_left(_PRIMES, n, lo=6)
        if i == len(_PRIMES):
            raise ValueError(f"CxxIntMap supports at most {_PRIMES[-1]} keys")
        self._next_resize = _PRIMES[i]
        return _PRIMES[i]

    def _need_rehash(self, num_after: int) -> int:
        """0, or the new bucket count (max load factor 1.0, growth factor 2)."""
        if num_after <= self._next_resize:
            return 0
        # A never-allocated table starts at >= 11 buckets (libstdc++'s comment says so).
        min_buckets = max(num_after, 0 if self._next_resize else 11)
        if min_buckets >= self._num_buckets:
            return self._next_bucket_count(max(min_buckets + 1, self._num_buckets * 2))
        self._next_resize = self._num_buckets
        return 0

    def _insert_bucket_begin(self, bucket: int, key: int) -> None:
        if bucket in self._buckets:
            before = self._buckets[bucket]
            self._next[key] = self._next[before]
            self._next[before] = key
            return
        first = self._next[_BEFORE_BEGIN]
        self._next[key] = first
        self._next[_BEFORE_BEGIN] = key
        if first is not None:
            self._buckets[_bucket_of(first, self._num_buckets)] = key
        self._buckets[bucket] = _BEFORE_BEGIN

    def _rehash(self, num_buckets: int) -> None:
        node = self._next[_BEFORE_BEGIN]
        self._next[_BEFORE_BEGIN] = None
        buckets: dict[int, int | None] = {}
        head_bucket = 0
        while node is not None:
            following = self._next[node]
            bucket = _bucket_of(node, num_buckets)
            if bucket not in buckets:
                self._next[node] = self._next[_BEFORE_BEGIN]
                self._next[_BEFORE_BEGIN] = node
                buckets[bucket] = _BEFORE_BEGIN
                if self._next[node] is not None:
                    buckets[head_bucket] = node
                head_bucket = bucket
            else:
                before = buckets[bucket]
                self._next[node] = self._next[before]
                self._next[before] = node
            node = following
        self._buckets = buckets
        self._num_buckets = num_buckets


class CxxMaxHeap(Generic[T]):
    """`std::priority_queue<T, vector<T>, Less>` comparing `key(item)` only.

    Ties pop in libstdc++'s order, which follows from its sift-down-to-a-leaf `pop_heap`.
    """

    __slots__ = ("_items", "_key")

    def __init__(self, key: Callable[[T], float]) -> None:
        self._items: list[T] = []
        self._key = key

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T) -> None:
        self._items.append(item)
        self._sift_up(len(self._items) - 1, 0, item)

    def pop(self) -> T:
        items = self._items
        top = items[0]
        last = items.pop()
        if items:  # pop_heap + pop_back: re-seat the old back element from the root hole
            self._adjust(0, len(items), last)
        return top

    def _sift_up(self, hole: int, top: int, item: T) -> None:
        items, key = self._items, self._key
        value = key(item)
        parent = (hole - 1) // 2
        while hole > top and key(items[parent]) < value:
            items[hole] = items[parent]
            hole = parent
            parent = (hole - 1) // 2
        items[hole] = item

    def _adjust(self, hole: int, length: int, item: T) -> None:
        """`std::__adjust_heap`: walk the hole down to a leaf, then sift `item` up."""
        items, key = self._items, self._key
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if key(items[child]) < key(items[child - 1]):
                child -= 1
            items[hole] = items[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            items[hole] = items[child - 1]
            hole = child - 1
        self._sift_up(hole, top, item)
