"""KV events: what a prefix cache holds, as chained hashes of its page-aligned blocks (a block's hash
covers its tokens and its parent's hash, as in vLLM's and SGLang's KV events), so that a router can
tell which replica holds the longest prefix of a prompt from the prompt alone.

The hash is Python's hash of a tuple of ints, which does not depend on PYTHONHASHSEED: every process
of one Python version (a Ray cluster runs one) computes the same. A collision costs only a routing
choice: the replica matches tokens, never hashes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cluster.messages import KVEvents

ROOT_HASH = 0  # the parent of a prompt's first block


def iter_block_hashes(ids: list[int], page_size: int, parent: int = ROOT_HASH) -> Iterator[int]:
    """The chained hash of each whole page of ids in turn (a partial last page has none): a caller
    that stops at the first block no cache holds hashes no further."""
    h = parent
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, tuple(ids[start : start + page_size])))
        yield h


def block_hashes(ids: list[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    return list(iter_block_hashes(ids, page_size, parent))


class BlockChanges:
    """Blocks stored and removed since the last `take`, netted: a block stored then removed (or removed
    then stored) in between is in neither, so applying both sets in any order to the state at the
    last take gives the state now."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self.removed: set[int] = set()

    def store(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self.removed:
                self.removed.discard(h)
            else:
                self.stored.add(h)

    def remove(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self.stored:
                self.stored.discard(h)
            else:
                self.removed.add(h)

    def take(self) -> tuple[list[int], list[int]]:
        out = list(self.stored), list(self.removed)
        self.stored, self.removed = set(), set()
        return out


class KVEventStream:
    """A replica's side of its KV events: every block its cache holds, and for each receiver (a router,
    by its index) the changes it has not been sent yet. A new receiver, or one that asks again
    (`resync`), is sent the whole set first, then changes only. Not thread-safe: the replica holds its
    lock around every call."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.held: set[int] = set()
        self._changes: dict[int, BlockChanges | None] = {}  # None: a snapshot is due

    def add(self, stored: list[int], removed: list[int]) -> None:
        """One step's netted changes (from the cache's BlockChanges)."""
        self.held.difference_update(removed)
        self.held.update(stored)
        for changes in self._changes.values():
            if changes is not None:
                changes.remove(removed)
                changes.store(stored)

    def resync(self, receiver: int = 0) -> None:
        self._changes[receiver] = None

    def snapshot_due(self, receiver: int = 0) -> bool:
        return self._changes.get(receiver) is None

    def drop(self, receiver: int) -> None:
        self._changes.pop(receiver, None)

    @property
    def receivers(self) -> list[int]:
        """The receivers it keeps changes (or a due snapshot) for."""
        return sorted(self._changes)

    def take(self, receiver: int = 0) -> KVEvents | None:
        """What to send receiver now: the whole set when a snapshot is due (the first time too), else the
        changes (None: nothing)."""
        changes = self._changes.get(receiver)
        if changes is None:
            self._changes[receiver] = BlockChanges()
            return KVEvents(self.page_size, stored=list(self.held), removed=[], full=True)
        stored, removed = changes.take()
        return KVEvents(self.page_size, stored, removed) if stored or removed else None
