"""Request slots: rows of the token pool and page table, one per running request.

Under overlap scheduling a slot freed while a batch that uses it is still in flight is only returned
once that batch is done: the in-flight batch will still write its sample into the row."""

from __future__ import annotations


class SlotReuseError(AssertionError):
    pass


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._deferred: list[int] = []
        self.defer = False  # set while a batch may be in flight

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self, in_flight: frozenset[int]) -> int:
        slot = self._free.pop()
        if slot in in_flight:
            raise SlotReuseError(f"request slot {slot} handed out while an in-flight batch still uses it")
        return slot

    def free(self, slot: int) -> None:
        (self._deferred if self.defer else self._free).append(slot)

    def release_deferred(self) -> None:
        self._free.extend(self._deferred)
        self._deferred.clear()

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)
