"""Token-granular slot accounting for the paged KV cache."""

from __future__ import annotations

import heapq
from typing import Any, Self, SupportsIndex

import numpy as np


class SlotAllocator:
    """The free KV slots, lowest first. Slot 0 is reserved as the harmless target of padded gathers.

    Lowest-first keeps a lone sequence's slots one contiguous range (rejected draft slots are
    the next ones handed out), so attention can read its K/V as a view of the cache instead of
    gathering it (layers/attention.py).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the KV cache needs at least 2 slots, got {num_slots}")
        self.num_slots = num_slots
        # Every slot from `_next` up is free (the never-used or returned tail, taken as a range);
        # `_holes` (a min-heap) holds the free slots below it. A heap of every free slot would
        # cost a request-step as much as drafting its tree; the holes are mostly one step's
        # rejected drafts, so this heap stays small.
        self._next = 1
        self._holes: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._holes) + self.num_slots - self._next

    @property
    def num_usable(self) -> int:
        return self.num_slots - 1

    def allocate(self, n: int) -> list[int] | None:
        """The n lowest free slots, ascending, or None (and nothing taken) when fewer are free."""
        if n > self.num_free:
            return None
        holes = self._holes
        if n <= len(holes):
            return [heapq.heappop(holes) for _ in range(n)]
        got = sorted(holes)  # every hole, all below _next: first
        holes.clear()
        start = self._next
        self._next = start + n - len(got)
        got += range(start, self._next)
        return got

    def free(self, slots: list[int]) -> None:
        holes = self._holes
        for slot in sorted(slots, reverse=True):  # a run ending at the tail rejoins it
            if slot == self._next - 1:
                self._next = slot
            else:
                heapq.heappush(holes, slot)


class SlotList(list):
    """A sequence's slots: a list that also keeps them in a numpy buffer, filled lazily.

    Every step sends each running sequence's cached slots to attention; reading tens of
    thousands of ints from Python lists every step is slow, and the lists change only at their
    tail. So each mutation records how far the buffer is still valid and `array()` copies only
    what changed since. Every mutating list method is overridden; a plain list in the same place still works (it is
    read the slow way)."""

    __slots__ = ("_buf", "_valid")

    def __init__(self, slots: Any = ()) -> None:
        super().__init__(slots)
        self._buf = np.zeros(max(16, len(self)), np.int64)
        self._valid = 0  # _buf[:_valid] equals self[:_valid]

    def __reduce__(self) -> tuple:
        return list, (list(self),)  # other processes get a plain list, not the buffer

    def array(self) -> np.ndarray:
        """[len] int64, the slots now (a view: valid until the next mutation)."""
        n = len(self)
        if n > len(self._buf):
            buf = np.zeros(max(n, 2 * len(self._buf)), np.int64)
            buf[: self._valid] = self._buf[: self._valid]
            self._buf = buf
        if self._valid < n:
            self._buf[self._valid : n] = self[self._valid : n]
            self._valid = n
        return self._buf[:n]

    # append, extend and += only add at the tail: what is buffered stays valid.

    def _changed_from(self, index: int) -> None:
        self._valid = min(self._valid, max(0, index))

    def __delitem__(self, key: SupportsIndex | slice) -> None:
        self._changed_from(_first_index(key, len(self)))
        super().__delitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._changed_from(_first_index(key, len(self)))
        super().__setitem__(key, value)

    def insert(self, index: SupportsIndex, value: Any) -> None:
        self._changed_from(_first_index(index, len(self)))
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> Any:
        self._changed_from(_first_index(index, len(self)))
        return super().pop(index)

    def remove(self, value: Any) -> None:
        self._changed_from(0)
        super().remove(value)

    def clear(self) -> None:
        self._changed_from(0)
        super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._changed_from(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._changed_from(0)
        super().reverse()

    def __imul__(self, count: SupportsIndex) -> Self:
        self._changed_from(0)
        return super().__imul__(count)


def _first_index(key: Any, length: int) -> int:
    """The first position a subscript or index may touch (0 when unsure)."""
    if isinstance(key, slice):
        start = key.indices(length)[0]
        return 0 if key.step not in (None, 1) else start
    index = int(key)
    return index + length if index < 0 else index
