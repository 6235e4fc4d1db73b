"""The free list of KV-cache pages."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        return list(self._free)
