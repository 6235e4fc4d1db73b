"""Speculative decoding on the scheduler's side: which requests speculate, the tokens proposed for
each row of a decode step (bounded by its remaining length, the step's token budget and the KV pages
available), and a request's state once its verify step's result says how many it kept.

A speculating request waits for its own result before its next step (as a constrained one does): its
next proposals depend on the tokens it keeps, which the host learns only then. The requests that do
not speculate go on in the overlap loop beside it. At launch a verify row advances as if every
proposal were kept; `accept` moves it back to what was and trims the pages of the rejected positions."""

from __future__ import annotations

from cluster.config import SchedulerConfig
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.ngram import propose_ngram
from cluster.scheduler.req import Req


class Speculator:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.cache = cache
        self.k, self.n_max = config.num_speculative_tokens, config.speculative_ngram_max
        self.max_step_tokens = config.max_extend_tokens
        self.num_draft_tokens = 0  # proposed, over every verify step
        self.num_accepted_tokens = 0  # of them, kept

    def propose(self, decoding: list[Req]) -> list[list[int]] | None:
        """Each row's proposals ([] for a row that does not speculate or found none); None when no row
        has any (a plain decode step). The pages they need come from what the step leaves available."""
        cache = self.cache
        pages = cache.available - sum(cache.extra_pages(r, r.cached_len + 1) for r in decoding)
        tokens = self.max_step_tokens - len(decoding)
        drafts: list[list[int]] = []
        for req in decoding:
            # at most max_tokens in all: the proposals and the token after them
            room = min(self.k, req.max_device_len - len(req.input_ids) - 1, tokens)
            found = propose_ngram(req.input_ids, room, self.n_max) if req.speculates and room > 0 else []
            base = cache.extra_pages(req, req.cached_len + 1)
            while found and cache.extra_pages(req, req.cached_len + 1 + len(found)) - base > pages:
                found.pop()
            pages -= cache.extra_pages(req, req.cached_len + 1 + len(found)) - base
            tokens -= len(found)
            drafts.append(found)
        return drafts if any(drafts) else None

    def accept(self, req: Req, num_drafts: int, num_new: int) -> None:
        """req's verify row proposed num_drafts tokens and keeps num_new samples (the accepted proposals
        and one more): its KV covers its input and the accepted ones; the rest is given back."""
        rejected = num_drafts + 1 - num_new
        req.cached_len -= rejected
        req.device_len -= rejected
        self.cache.trim(req, req.cached_len)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_new - 1
