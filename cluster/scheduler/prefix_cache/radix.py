"""A radix tree over token ids, one edge unit per page: requests that share a prompt prefix share its
KV pages. Reference counts keep pages in use; unreferenced leaves are evicted least recently used.

Once the cache fills the memory requests leave free, every page a request allocates comes from an
eviction, so eviction must not walk the tree: a heap holds each leaf as it becomes evictable, keyed
by its last use then. Entries go stale (the leaf was locked, touched, given a child, or evicted) and
are checked when popped; the heap is rebuilt when stale entries outnumber the nodes.

Each node keeps the chained hash of each of its pages (events.block_hashes over the path from the
root), so what it stores and evicts is reported as KV events without rehashing a prefix."""

from __future__ import annotations

import heapq
import itertools

from cluster.scheduler.prefix_cache.base import PrefixCache
from cluster.scheduler.prefix_cache.events import ROOT_HASH, block_hashes


class Node:
    __slots__ = ("tokens", "pages", "hashes", "parent", "children", "ref", "last_use")

    def __init__(self, tokens: list[int], pages: list[int], parent: Node | None, hashes: list[int]) -> None:
        self.tokens, self.pages, self.parent, self.hashes = tokens, pages, parent, hashes
        self.children: dict[tuple[int, ...], Node] = {}
        self.ref = 0
        self.last_use = 0


class RadixCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.root = Node([], [], None, [])
        self.root.ref = 1  # never evicted
        self._pages = 0
        self._evictable = 0
        self._clock = itertools.count(1)
        self._num_nodes = 1
        self._leaves: list[tuple[int, int, Node]] = []  # (last use when pushed, tie-break, leaf)
        self._tie = itertools.count()

    @staticmethod
    def _is_evictable_leaf(node: Node) -> bool:
        return node.ref == 0 and not node.children and node.parent is not None  # the root has no parent

    def _push_if_evictable(self, node: Node) -> None:
        if self._is_evictable_leaf(node):
            if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale: rebuild (amortized O(1))
                self._rebuild_heap()
            heapq.heappush(self._leaves, (node.last_use, next(self._tie), node))

    @property
    def num_pages(self) -> int:
        return self._pages

    @property
    def num_evictable(self) -> int:
        return self._evictable

    def _key(self, ids: list[int], at: int) -> tuple[int, ...]:
        return tuple(ids[at : at + self.page_size])

    def _walk(self, ids: list[int]) -> tuple[Node, int, list[int]]:
        """Follows ids down the tree, splitting an edge where the match ends inside it.
        Returns (deepest matched node, tokens matched, their pages)."""
        ps, node, at, pages = self.page_size, self.root, 0, []
        now = next(self._clock)
        node.last_use = now
        while len(ids) - at >= ps:
            child = node.children.get(self._key(ids, at))
            if child is None:
                break
            n = 1  # pages of the child's edge that match (the first one does, by its key)
            while n < len(child.pages) and child.tokens[n * ps : (n + 1) * ps] == ids[at + n * ps : at + (n + 1) * ps]:
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_use = now
            pages.extend(child.pages)
            at += n * ps
            node = child
        return node, at, pages

    def _split(self, child: Node, n: int) -> Node:
        """Cuts child's edge after n pages; returns the new upper part."""
        ps = self.page_size
        upper = Node(child.tokens[: n * ps], child.pages[:n], child.parent, child.hashes[:n])
        upper.ref, upper.last_use = child.ref, child.last_use
        child.parent.children[self._key(upper.tokens, 0)] = upper
        child.tokens, child.pages, child.parent = child.tokens[n * ps :], child.pages[n:], upper
        child.hashes = child.hashes[n:]
        upper.children[self._key(child.tokens, 0)] = child
        self._num_nodes += 1
        return upper

    def match(self, ids: list[int]) -> tuple[Node, list[int]]:
        node, _, pages = self._walk(ids)
        return node, pages

    def insert(self, ids: list[int], pages: list[int]) -> tuple[Node, list[int]]:
        assert len(ids) == len(pages) * self.page_size, "insert takes whole pages"
        node, at, cached = self._walk(ids)
        if at < len(ids):
            tail = list(ids[at:])
            leaf = Node(
                tail,
                list(pages[at // self.page_size :]),
                node,
                block_hashes(tail, self.page_size, node.hashes[-1] if node.hashes else ROOT_HASH),
            )
            self.events.store(leaf.hashes)
            leaf.last_use = node.last_use
            node.children[self._key(leaf.tokens, 0)] = leaf
            self._pages += len(leaf.pages)
            self._evictable += len(leaf.pages)
            self._num_nodes += 1
            self._push_if_evictable(leaf)
            cached = cached + leaf.pages
            node = leaf
        return node, cached

    def lock(self, handle: Node) -> None:
        node = handle
        while node is not None:
            if node.ref == 0:
                self._evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, handle: Node) -> None:
        node = handle
        while node is not None:
            node.ref -= 1
            assert node.ref >= 0, "prefix-cache node unlocked more often than locked"
            if node.ref == 0:
                self._evictable += len(node.pages)
                self._push_if_evictable(node)
            node = node.parent

    def evict(self, n: int) -> list[int]:
        freed: list[int] = []
        while self._leaves and len(freed) < n:  # not aliased: a push below may rebuild the heap
            used, _, leaf = heapq.heappop(self._leaves)
            if not self._is_evictable_leaf(leaf):
                continue  # stale: locked, no longer a leaf, or gone; pushed again when evictable
            if leaf.last_use != used:  # touched since it was pushed: back in at its place
                heapq.heappush(self._leaves, (leaf.last_use, next(self._tie), leaf))
                continue
            k = n - len(freed)
            if k < len(leaf.pages):  # only its last k pages: the rest of the prefix stays cached
                freed.extend(leaf.pages[-k:])
                self.events.remove(leaf.hashes[-k:])
                del leaf.pages[-k:], leaf.tokens[-k * self.page_size :], leaf.hashes[-k:]
                self._pages -= k
                self._evictable -= k
                heapq.heappush(self._leaves, (leaf.last_use, next(self._tie), leaf))
                break
            parent = leaf.parent
            del parent.children[self._key(leaf.tokens, 0)]
            leaf.parent = None
            self._num_nodes -= 1
            freed.extend(leaf.pages)
            self.events.remove(leaf.hashes)
            self._pages -= len(leaf.pages)
            self._evictable -= len(leaf.pages)
            self._push_if_evictable(parent)
        return freed

    def _rebuild_heap(self) -> None:
        self._leaves = [(x.last_use, next(self._tie), x) for x in self._nodes() if self._is_evictable_leaf(x)]
        heapq.heapify(self._leaves)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]
