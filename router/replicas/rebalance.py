"""Rebalancing when a replica joins the routing (the fleet grew, a failed replica was replaced, one
retiring for scale-down takes requests again). Requests are sent to a replica as they arrive and wait in
its own queue, so a backlog that built up before the newcomer served would otherwise stay where it is
while the newcomer idles. Each router moves its own requests that are still waiting (sent, no token yet
from that replica) from its busiest replicas to its idlest until their counts are within one of each
other. A move is a migration (router/replicas/migration.py) before the prefill: the request goes to the
other replica as it stands (as first sent, or the continuation it already is) and is aborted where it
waited, so its output is the same. A request that has produced a token there stays: moving it would cost
its prefill again. Every router does this for its own requests, so together they even out the fleet."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# replicas whose loads differ by less than this are left as they are (moving one request between
# loads 5 and 4 would only swap them)
MIN_GAP = 2


@dataclass(frozen=True)
class Move:
    """`count` waiting requests from the replica at index `source` to the one at `target`."""

    source: int
    target: int
    count: int


def plan(loads: list[int], waiting: list[int], min_gap: int = MIN_GAP) -> list[Move]:
    """The moves that even out `loads` (each replica's requests, running or waiting) by moving at most
    `waiting[i]` requests off replica i: one at a time from the most loaded replica that has a waiting
    request to the least loaded, while they differ by at least min_gap."""
    if len(loads) != len(waiting):
        raise ValueError(f"{len(loads)} loads against {len(waiting)} waiting counts")
    if min_gap < 1:
        raise ValueError(f"min_gap must be at least 1, not {min_gap}")
    loads, left = list(loads), list(waiting)
    counts: dict[tuple[int, int], int] = {}
    while True:
        sources = [i for i in range(len(loads)) if left[i] > 0]
        if not sources:
            break
        source = max(sources, key=lambda i: loads[i])
        target = min(range(len(loads)), key=lambda i: loads[i])
        if loads[source] - loads[target] < min_gap:
            break
        loads[source], loads[target], left[source] = loads[source] - 1, loads[target] + 1, left[source] - 1
        counts[source, target] = counts.get((source, target), 0) + 1
    return [Move(s, t, n) for (s, t), n in counts.items()]


def rebalance(clients: list) -> int:
    """Hands this router's waiting requests from its busier replicas' clients to its idler ones'
    (ReplicaClient.hand_over) as `plan` says; how many were handed over. On the router's event loop."""
    up = [c for c in clients if c.healthy]
    # requests handed over by an earlier rebalance whose generation has not moved them yet count where
    # they are going
    incoming = Counter(id(to) for c in up for to in c.outgoing)
    loads = [c.load - len(c.outgoing) + incoming[id(c)] for c in up]
    moves = plan(loads, [len(c.waiting) for c in up])
    return sum(up[m.source].hand_over(m.count, up[m.target]) for m in moves)
