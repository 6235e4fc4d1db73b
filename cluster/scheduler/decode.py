"""The decode manager: the running set (requests past their prefill, one token each per decode step)
and making room for a decode step, by preempting requests that have outgrown their reservation
(lowest priority, then newest, first) when the step needs more KV pages than are available."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.prefill import PrefillManager, queue_order
from cluster.scheduler.req import Req

log = logging.getLogger(__name__)


class DecodeManager:
    def __init__(
        self,
        cache: CacheManager,
        prefill: PrefillManager,
        free: Callable[[Req], None],
        longest_first: bool = False,
    ) -> None:
        """`free` gives back what a request holds (its pages, its request slot) and drops a result of it
        still in flight: a preempted request goes back to `prefill`'s queue without them. `longest_first`:
        a step's rows in order of their KV length, the longest first (ties in running order), so that an
        attention kernel that starts its programs in row order starts the longest requests' first; a
        row's output does not depend on its place."""
        self.cache, self.prefill, self.free = cache, prefill, free
        self.longest_first = longest_first
        self.running: dict[int, Req] = {}  # by uid, in the order they finished their prefill
        self.num_preempted = 0

    def add(self, req: Req) -> None:
        self.running[req.uid] = req

    def remove(self, req: Req) -> bool:
        """False when req was not running."""
        return self.running.pop(req.uid, None) is not None

    @property
    def headroom(self) -> int:
        """Pages to leave free when admitting: one each for running requests past their reservation, so
        that admitting into their next pages does not preempt someone at the next step."""
        return sum(1 for r in self.running.values() if r.may_outgrow and not r.reserved_pages)

    def schedule(self, in_flight: frozenset[Req] | None, speculating: bool = False) -> list[Req]:
        """The requests to decode this step (`in_flight`: the requests of the step in flight, if one is),
        after making room. A constrained request whose last token is in flight waits for it (its grammar
        must see that token before its next mask can be built), and one whose proposals are being
        verified (its state is provisional until then); with `speculating`, every speculating one (its
        next proposals follow from the tokens it keeps) but those its back-off pauses. A request in
        speculation's pipeline waits only where the tokens its row in flight adds are unknown."""
        decoding = [
            r
            for r in self.running.values()
            if r.can_decode and not (self._waits(r, speculating) and in_flight and r in in_flight)
        ]
        decoding = self._make_room(decoding, in_flight is not None)
        if self.longest_first:
            decoding.sort(key=_kv_length, reverse=True)  # stable: ties keep running order
        return decoding

    @staticmethod
    def _waits(req: Req, speculating: bool) -> bool:
        """Whether req, if its last step is in flight, waits for its result before its next one."""
        # a mask that follows the output (a grammar's, bad words') is known only once the last token is;
        # allowed_token_ids alone mask every step alike, and such a request decodes in the overlap loop
        if req.matcher is not None and getattr(req.matcher, "follows_output", True):
            return True
        if req.pipelines:
            # a row launched after its row in flight is void if that one keeps fewer: it waits where its
            # next proposals are unknown (tail None), or where its last bet lost (a row in flight behind
            # a verify step cut short); with only a void row in flight (tail []) there is no bet to take
            lost = bool(req.tail) and not req.kept_all
            return speculating and not req.spec_pause and (req.tail is None or lost)
        return req.verifying or (speculating and req.speculates and not req.spec_pause)

    def _make_room(self, decoding: list[Req], in_flight: bool) -> list[Req]:
        """Preempts requests that have outgrown their reservation, the last in queue order first (the
        lowest priority, a higher number, then the newest), until the pages this
        decode step needs beyond reservations are available. Reservations are never taken: a request
        whose max_tokens fit its reservation runs to its end."""
        cache = self.cache
        if cache.available >= len(decoding):  # a decode step takes at most one page per request
            return decoding
        need = sum(cache.extra_pages(r, r.cached_len + 1) for r in decoding)
        if need <= cache.available:
            return decoding
        if in_flight:
            # requests whose last token is in flight free their pages once it is handled, after this
            # launch: if that covers the shortage, the requests short of a page wait one step instead
            ending = sum(len(r.pages) + r.reserved_pages for r in self.running.values() if not r.can_decode)
            if need <= cache.available + ending:
                return [r for r in decoding if cache.extra_pages(r, r.cached_len + 1) == 0]
        for victim in sorted((r for r in decoding if r.may_outgrow), key=queue_order, reverse=True):
            need -= cache.extra_pages(victim, victim.cached_len + 1)
            self._preempt(victim)
            if need <= cache.available:
                break
        return [r for r in decoding if r.slot >= 0]

    def _preempt(self, req: Req) -> None:
        """Frees a running request's pages (its computed ones go to the prefix cache) and queues it
        again, in front of the later requests of its priority, to be prefilled over all its tokens;
        sampling is a function of (seed, position), so it goes on with the tokens it would have produced."""
        del self.running[req.uid]
        self.free(req)  # a result of it in flight is dropped: that token is recomputed
        req.cached_len = req.prefix_hit_len = 0
        req.fill_len = req.device_len = len(req.input_ids)
        req.num_preempted += 1
        self.num_preempted += 1
        if req.scores_prompt:  # its last chunk's scores were in flight, dropped: the recompute scores it all
            req.prompt_logprobs = []
        self.prefill.add(req)
        log.debug("preempted request %d at %d tokens", req.uid, req.fill_len)


def _kv_length(req: Req) -> int:
    return req.cached_len
