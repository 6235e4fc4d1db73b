"""Choosing a replica for a request. Cache-exact: send a prompt to the replica whose prefix cache holds
the longest prefix of it, as its KV events tell (router/replicas/client.py), unless that replica is
much busier than the least loaded one; otherwise the less loaded of two chosen at random.
Cache-aware: the same on what the router once sent where (it never sees an eviction, nor what other
routers sent). Round-robin is the simple alternative. Each picks among the replicas whose queue has
room for the request (`with_room`)."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

from cluster import OverloadedError, iter_block_hashes


class NoReplicaError(RuntimeError):
    pass


def _healthy(replicas: list) -> list:
    up = [r for r in replicas if r.healthy]
    if not up:
        raise NoReplicaError("no replica is ready to serve")
    return up


def with_room(
    replicas: list, num_tokens: int, max_requests: int | None, max_tokens: int | None, num_requests: int = 1
) -> list:
    """The healthy replicas whose queue bounds (max_queued_requests, max_queued_tokens) have room for
    num_requests requests of num_tokens (the n choices of one request go to one replica); OverloadedError
    when none has."""
    up = _healthy(replicas)
    room = [r for r in up if r.has_room(num_tokens, max_requests, max_tokens, num_requests)]
    if not room:
        raise OverloadedError(f"the server is busy: every replica's queue is full ({len(up)} replica(s)); retry later")
    return room


class RoundRobin:
    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, replicas: list, ids: list[int]):
        up = _healthy(replicas)
        return up[next(self._next) % len(up)]


class CacheAware:
    def __init__(self, block: int = 16, balance_slack: int = 8, capacity: int = 200_000) -> None:
        self.block, self.balance_slack, self.capacity = block, balance_slack, capacity
        self._seen: dict[int, OrderedDict] = {}  # replica id -> prefix-block hashes it was sent, LRU
        self._fallback = RoundRobin()

    def _hashes(self, ids: list[int]) -> list[int]:
        out, h = [], 0
        for start in range(0, len(ids) - self.block + 1, self.block):
            h = hash((h, tuple(ids[start : start + self.block])))
            out.append(h)
        return out

    def pick(self, replicas: list, ids: list[int]):
        up = _healthy(replicas)
        hashes = self._hashes(ids)
        least = min(r.load for r in up)

        def matched(r) -> int:
            seen = self._seen.get(r.replica_id, {})
            n = 0
            while n < len(hashes) and hashes[n] in seen:
                n += 1
            return n

        best = max(up, key=matched)
        if matched(best) > 0 and best.load <= least + self.balance_slack:
            choice = best
        else:
            idle = [r for r in up if r.load == least]
            choice = self._fallback.pick(idle, ids)
        self._remember(choice.replica_id, hashes)
        return choice

    def _remember(self, replica_id: int, hashes: list[int]) -> None:
        seen = self._seen.setdefault(replica_id, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


class CacheExact:
    """Routes on the block hashes each replica's cache holds (`kv_blocks`, hashed with its `page_size`).
    A replica is too busy when its load exceeds both the least load plus balance_abs and the least
    load times balance_rel (SGLang's router bounds imbalance the same way). Load is `routing_load`: the
    replica's own count of its requests, which holds every router's."""

    def __init__(self, balance_abs: int = 8, balance_rel: float = 1.5, seed: int | None = None) -> None:
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._rng = random.Random(seed)

    def pick(self, replicas: list, ids: list[int]):
        up = _healthy(replicas)
        least = min(r.routing_load for r in up)
        limit = max(least + self.balance_abs, least * self.balance_rel)
        by_page_size: dict[int, list] = {}
        for r in up:
            if r.routing_load <= limit and r.kv_blocks:
                by_page_size.setdefault(r.page_size, []).append(r)
        best, best_tokens = None, 0
        for page_size, holders in by_page_size.items():
            n = 0
            # at least one token is computed, so the last is never a hit; hashing stops where no
            # replica holds the block (a cache holds a block only with its parent)
            for h in iter_block_hashes(ids[: len(ids) - 1], page_size):
                still = [r for r in holders if h in r.kv_blocks]
                if not still:
                    break
                holders, n = still, n + 1
            if n and n * page_size >= best_tokens:
                choice = min(holders, key=lambda r: r.routing_load)
                if n * page_size > best_tokens or choice.routing_load < best.routing_load:
                    best, best_tokens = choice, n * page_size
        return best if best is not None else self.two_choices(up)

    def two_choices(self, up: list):
        """The less loaded of two replicas drawn at random: near the least loaded, without every router
        sending its next request to the same one."""
        if len(up) == 1:
            return up[0]
        a, b = self._rng.sample(up, 2)
        return b if b.routing_load < a.routing_load else a


POLICIES = {"cache_exact": CacheExact, "cache_aware": CacheAware, "round_robin": RoundRobin}


def create_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose {', '.join(POLICIES)}")
    return POLICIES[name]()
