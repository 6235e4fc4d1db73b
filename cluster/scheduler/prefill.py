"""The prefill manager: the queue of requests waiting for their prefill, ordered by priority (lower
first) then arrival, and bounded when the settings say so (a full queue refuses new requests);
admitted in that order within a token budget, long prompts in chunks."""

from __future__ import annotations

from bisect import insort

from cluster.config import SchedulerConfig
from cluster.errors import OverloadedError
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.req import Req
from cluster.scheduler.request_slots import RequestSlots


class PrefillManager:
    def __init__(self, cache: CacheManager, req_slots: RequestSlots, config: SchedulerConfig) -> None:
        self.cache, self.req_slots = cache, req_slots
        self.max_extend_tokens = config.max_extend_tokens
        self.max_queued_requests, self.max_queued_tokens = config.max_queued_requests, config.max_queued_tokens
        self.waiting: list[Req] = []  # in queue_order; the head may be part-way through a chunked prefill
        self.queued_tokens = 0  # tokens to prefill (fill_len) of the waiting requests

    def check_room(self, num_tokens: int) -> None:
        """Raises OverloadedError when a new request of num_tokens to prefill would overfill the queue.
        An empty queue takes any request, so a prompt longer than max_queued_tokens still runs (alone)."""
        n, bound = len(self.waiting), self.max_queued_requests
        if bound is not None and n >= bound:
            raise OverloadedError(f"the server is busy: {n} requests are waiting (at most {bound}); retry later")
        bound = self.max_queued_tokens
        if bound is not None and n and self.queued_tokens + num_tokens > bound:
            raise OverloadedError(
                f"the server is busy: {self.queued_tokens} prompt tokens are waiting and this "
                f"request has {num_tokens} (at most {bound} may wait); retry later"
            )

    def add(self, req: Req) -> None:
        """Queues req behind every request of its priority or a higher one (a lower number) that came
        before it. A preempted request comes back this way too, so it goes in front of the later ones of
        its priority; it was accepted already: the bounds do not apply."""
        # a head part-way through its chunked prefill holds pages and a request slot: it keeps its place
        start = 1 if self.waiting and self.waiting[0].slot >= 0 else 0
        insort(self.waiting, req, lo=start, key=queue_order)
        self.queued_tokens += req.fill_len

    def remove(self, req: Req) -> None:
        if req not in self.waiting:  # chosen for a prefill step that was never built
            return
        self.waiting.remove(req)
        self.queued_tokens -= req.fill_len

    def schedule(
        self, in_flight: frozenset[int], headroom: int = 0, budget: int | None = None
    ) -> list[tuple[Req, int]]:
        """Picks (request, tokens to compute) in queue order until the budget (max_extend_tokens unless
        given) is spent. A request that does not fit whole takes what is left and carries on next time,
        at the head of the queue. `in_flight`: the request slots of the batch in flight. `headroom` pages
        are left free at admission for running requests past their reservation."""
        batch: list[tuple[Req, int]] = []
        budget, whole = self.max_extend_tokens if budget is None else budget, set()
        for req in self.waiting:
            if budget == 0:
                break
            if req.held:
                continue  # a later choice of a prompt not cached yet: the requests behind it go first
            if req.slot < 0:
                if self.req_slots.available == 0 or not self.cache.admit(req, headroom):
                    break  # in queue order: later (or lower-priority) requests do not jump the queue
                req.slot = self.req_slots.allocate(in_flight)
            ext = min(req.extend_len, budget)
            budget -= ext
            batch.append((req, ext))
            if ext < req.extend_len:
                if self.waiting[0] is not req:  # past held choices: it holds a slot, so it leads from now on
                    self.waiting.remove(req)
                    self.waiting.insert(0, req)
                break
            whole.add(req)
            # its prompt ends in this step: its first decode needs a page beyond its reservation (none with
            # decode_reserve_tokens 0) that a request admitted after it must leave free, or that decode
            # preempts it with its first token in flight, and the two can take turns forever
            if req.fill_len + 1 < req.max_device_len and self.cache.pages_for(req.fill_len + 1) > req.reserve_limit:
                headroom += 1
        if whole:
            self.queued_tokens -= sum(req.fill_len for req in whole)
            self.waiting = [req for req in self.waiting if req not in whole]
        return batch


def queue_order(req: Req) -> tuple[int, float]:
    """Lower priority numbers first (vLLM's meaning), then arrival."""
    return req.params.priority, req.arrival
