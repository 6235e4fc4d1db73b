"""The prefix-cache interface. Pages handed to `insert` belong to the cache from then on; pages of a
locked handle's path are never evicted. A cache records the chained hashes of the blocks it stores
and removes (its KV events, cluster/scheduler/prefix_cache/events.py) for `take_events`."""

from __future__ import annotations

from abc import ABC, abstractmethod

from cluster.scheduler.prefix_cache.events import BlockChanges


class PrefixCache(ABC):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events = BlockChanges()

    def take_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) block hashes since the last call, netted."""
        return self.events.take()

    @abstractmethod
    def match(self, ids: list[int]) -> tuple[object, list[int]]:
        """The longest cached page-aligned prefix of ids: (handle, its pages)."""

    @abstractmethod
    def insert(self, ids: list[int], pages: list[int]) -> tuple[object, list[int]]:
        """Caches ids (page-aligned, one page per page_size tokens). Returns (handle, the cache's pages
        for ids): where a prefix was cached already, its pages differ from the given ones, which the
        caller then frees."""

    @abstractmethod
    def lock(self, handle: object) -> None: ...

    @abstractmethod
    def unlock(self, handle: object) -> None: ...

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Drops at least n unlocked pages (least recently used first), or every one there is."""

    @property
    @abstractmethod
    def num_pages(self) -> int:
        """Pages the cache holds."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Pages it holds that no live request has locked."""

    @abstractmethod
    def all_pages(self) -> list[int]:
        """Every page the cache holds (for integrity checks)."""
