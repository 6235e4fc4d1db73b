"""Choosing a replica for a request. Cache-aware (default): send a prompt where its prefix was sent
before, so that replica's radix cache already holds it, unless that replica is much busier than the
least loaded one; otherwise the least loaded. Round-robin is the simple alternative. Either picks
among the replicas whose queue has room for the request (`with_room`)."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from cluster import OverloadedError


class NoReplicaError(RuntimeError):
    pass


def _healthy(replicas: list) -> list:
    up = [r for r in replicas if r.healthy]
    if not up:
        raise NoReplicaError("no replica is ready to serve")
    return up


def with_room(replicas: list, num_tokens: int, max_requests: int | None, max_tokens: int | None,
              num_requests: int = 1) -> list:
    """The healthy replicas whose queue bounds (max_queued_requests, max_queued_tokens) have room for
    num_requests requests of num_tokens (the n choices of one request go to one replica); OverloadedError
    when none has."""
    up = _healthy(replicas)
    room = [r for r in up if r.has_room(num_tokens, max_requests, max_tokens, num_requests)]
    if not room:
        raise OverloadedError(f"the server is busy: every replica's queue is full ({len(up)} replica(s)); "
                              "retry later")
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
            h = hash((h, tuple(ids[start:start + self.block])))
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


def create_policy(name: str):
    if name == "cache_aware":
        return CacheAware()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; choose cache_aware or round_robin")
