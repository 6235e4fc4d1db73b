"""Request slots: rows of the token pool and page table (`Req.slot`), one per running request.

A freed request slot is not handed out again until the scheduler has waited for the batch in flight:
that batch may still write its sample into the row. The scheduler releases freed slots after every
wait for a step's results, and at once when nothing is in flight."""

from __future__ import annotations


class RequestSlotReuseError(AssertionError):
    pass


class RequestSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._freed: list[int] = []  # freed, not yet released

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def num_unreleased(self) -> int:
        return len(self._freed)

    def allocate(self, in_flight: frozenset[int]) -> int:
        """A free request slot; `in_flight` holds the slots of the batch in flight, which it must not be."""
        slot = self._free.pop()
        if slot in in_flight:
            raise RequestSlotReuseError(f"request slot {slot} handed out while an in-flight batch still uses it")
        return slot

    def free(self, slot: int) -> None:
        self._freed.append(slot)

    def release(self) -> None:
        """Makes every freed slot available: call once no batch that used them can still be running."""
        self._free.extend(self._freed)
        self._freed.clear()
