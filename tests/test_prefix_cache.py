"""The radix prefix cache on its own: eviction takes the last pages of the least recently used unlocked
leaf, the same choice a walk over the whole tree makes, through random inserts, matches, locks and
evictions; and pages are neither lost nor duplicated."""

from __future__ import annotations

import random

import pytest

from cluster.scheduler.prefix_cache.radix import Node, RadixCache

PAGE = 2


def _nodes(cache: RadixCache) -> list[Node]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _lru_leaves(cache: RadixCache) -> tuple[int, list[Node]]:
    """By walking the tree: the oldest last use among unlocked leaves, and the leaves that have it."""
    leaves = [x for x in _nodes(cache) if not x.children and x.ref == 0 and x is not cache.root]
    if not leaves:
        return 0, []
    oldest = min(x.last_use for x in leaves)
    return oldest, [x for x in leaves if x.last_use == oldest]


@pytest.mark.parametrize("seed", range(6))
def test_eviction_takes_the_least_recently_used_unlocked_leaf(seed: int):
    rng = random.Random(seed)
    cache = RadixCache(PAGE)
    # few distinct tokens and short prompts: prompts share prefixes and edges get split
    prompts = [[rng.randrange(3) for _ in range(PAGE * rng.randrange(1, 6))] for _ in range(40)]
    next_page, held, evicted = 0, [], set()
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            ids = rng.choice(prompts)
            pages = list(range(next_page, next_page + len(ids) // PAGE))
            next_page += len(pages)
            handle, cached = cache.insert(ids, pages)
            evicted.update(p for p, c in zip(pages, cached) if p != c)  # duplicates the caller frees
            if rng.random() < 0.5:
                cache.lock(handle)
                held.append(handle)
        elif op < 0.55:
            handle, _ = cache.match(rng.choice(prompts))
            cache.lock(handle)
            held.append(handle)
        elif op < 0.75 and held:
            cache.unlock(held.pop(rng.randrange(len(held))))
        else:
            oldest, expected = _lru_leaves(cache)
            tails = [leaf.pages[-1:] for leaf in expected]
            freed = cache.evict(1)
            if not expected:
                assert freed == []
                continue
            assert freed in tails, f"evicted {freed}, not the last page of a leaf last used at {oldest}"
            evicted.update(freed)
        in_tree = [p for node in _nodes(cache) for p in node.pages]
        assert len(in_tree) == len(set(in_tree)) == cache.num_pages
        assert set(in_tree) | evicted == set(range(next_page)) and not set(in_tree) & evicted
        assert cache.num_evictable == sum(len(x.pages) for x in _nodes(cache) if x.ref == 0)
    for handle in held:
        cache.unlock(handle)
    cache.evict(next_page)  # everything unlocked goes
    assert cache.num_pages == cache.num_evictable == 0 and cache.root.children == {}


def test_many_lock_cycles_without_eviction_keep_the_heap_bounded():
    """A cache that never fills never evicts; its bookkeeping must not grow with the requests served."""
    cache = RadixCache(PAGE)
    handle, _ = cache.insert([1, 2, 3, 4], [0, 1])
    for _ in range(10_000):
        cache.lock(handle)
        cache.unlock(handle)
    assert len(cache._leaves) <= 2 * cache._num_nodes + 64 + 1
    assert cache.evict(1) == [1]  # the tail page only: the prefix stays cached
    assert cache.match([1, 2, 3, 4])[1] == [0]


@pytest.mark.parametrize("cycles", [150, 200, 240, 260])
def test_one_eviction_frees_every_evictable_page_it_is_asked_for_while_the_heap_is_rebuilt(cycles: int):
    """Evicting a long chain exposes one parent per eviction; a rebuild of a mostly stale heap part-way
    through must not lose them."""
    cache = RadixCache(PAGE)
    chain = list(range(200))  # 100 pages
    cache.insert(chain, list(range(100)))
    for k in range(1, 100):  # matching every prefix splits the edge into 100 one-page nodes
        cache.match(chain[: k * PAGE])
    hot, _ = cache.insert([7, 7, 7, 7], [100, 101])
    for _ in range(cycles):  # stale heap entries, all more recent than the chain
        cache.match([7, 7, 7, 7])
        cache.lock(hot)
        cache.unlock(hot)
    cache.lock(hot)
    assert cache.num_evictable == 100
    assert sorted(cache.evict(100)) == list(range(100))
    assert cache.num_evictable == 0 and cache.num_pages == 2
