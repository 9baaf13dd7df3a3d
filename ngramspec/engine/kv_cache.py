"""Token-granular slot accounting for the paged KV cache."""

from __future__ import annotations


class SlotAllocator:
    """A free list of KV slots. Slot 0 is reserved as the harmless target of padded gathers."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the KV cache needs at least 2 slots, got {num_slots}")
        self.num_slots = num_slots
        # Popped from the end, so low slots go first and gathers stay local.
        self._free = list(range(num_slots - 1, 0, -1))
        self._used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_slots - 1

    def allocate(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
