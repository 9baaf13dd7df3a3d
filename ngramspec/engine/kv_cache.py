"""Token-granular slot accounting for the paged KV cache."""

from __future__ import annotations

import heapq


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
        self._free = list(range(1, num_slots))  # a sorted list is already a min-heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_slots - 1

    def allocate(self, n: int) -> list[int] | None:
        """The n lowest free slots, ascending, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)
