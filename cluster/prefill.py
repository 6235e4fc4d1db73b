"""The prefill manager: the queue of requests waiting for their prefill, admitted in arrival order
within a token budget, long prompts in chunks."""

from __future__ import annotations

from collections import deque

from cluster.cache_manager import CacheManager
from cluster.req import Req
from cluster.request_slots import RequestSlots


class PrefillManager:
    def __init__(self, cache: CacheManager, req_slots: RequestSlots, max_extend_tokens: int) -> None:
        self.cache, self.req_slots = cache, req_slots
        self.max_extend_tokens = max_extend_tokens
        self.waiting: deque[Req] = deque()  # the head may be part-way through a chunked prefill

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """Puts a preempted request first: the newest preempted goes in front of those preempted before."""
        self.waiting.appendleft(req)

    def remove(self, req: Req) -> None:
        self.waiting.remove(req)

    def schedule(self, in_flight: frozenset[int], headroom: int = 0) -> list[tuple[Req, int]]:
        """Picks (request, tokens to compute) in arrival order until the budget is spent. A request
        that does not fit whole takes what is left and carries on next time, at the head of the queue.
        `in_flight`: the request slots of the batch in flight. `headroom` pages are left free at
        admission for running requests past their reservation."""
        batch: list[tuple[Req, int]] = []
        budget = self.max_extend_tokens
        for req in list(self.waiting):
            if budget == 0:
                break
            if req.table_idx < 0:
                if self.req_slots.available == 0 or not self.cache.admit(req, headroom):
                    break  # first come, first served: later requests do not jump the queue
                req.table_idx = self.req_slots.allocate(in_flight)
            ext = min(req.extend_len, budget)
            budget -= ext
            batch.append((req, ext))
            if ext < req.extend_len:
                break
            self.waiting.popleft()
        return batch
