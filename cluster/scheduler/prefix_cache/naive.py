"""No sharing: nothing is ever cached, every request computes its whole prompt."""

from __future__ import annotations

from cluster.scheduler.prefix_cache.base import PrefixCache


class NaiveCache(PrefixCache):
    def match(self, ids: list[int]) -> tuple[object, list[int]]:
        return None, []

    def insert(self, ids: list[int], pages: list[int]) -> tuple[object, list[int]]:
        raise NotImplementedError("the naive cache keeps nothing")

    def lock(self, handle: object) -> None:
        pass

    def unlock(self, handle: object) -> None:
        pass

    def evict(self, n: int) -> list[int]:
        return []

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def num_evictable(self) -> int:
        return 0

    def all_pages(self) -> list[int]:
        return []
