"""Speculative decoding on the scheduler's side: the tokens proposed for each row of a decode step (by
n-gram lookup, ngram.py, or a draft model, draft.py; bounded by its remaining length, its min_tokens,
the step's token budget and the KV pages available), and a request's state once its verify step's
result says how many it kept.

While speculation is active (at most speculative_max_batch requests decode), a speculating request
waits for its own result before its next step (as a constrained one does): its next proposals depend
on the tokens it keeps, which the host learns only then. Every request speculates: a constrained
one's proposals are cut where its grammar rejects one, and each of its samples is masked by the
grammar's state after the proposals before it (Grammars.verify_masks); penalties count the proposals
before each sample (worker/sampling/processors.py). Past speculative_max_batch, every request
decodes in the overlap loop. At launch a verify row advances as if every proposal were kept; `accept`
moves it back to what was and trims the pages of the rejected positions.

Waiting costs the overlap: the host's work between two of the request's steps leaves the device idle.
So a request whose proposals do not pay backs off: after a row whose lookup found nothing, or whose
proposals were all rejected, it decodes in the overlap loop (not waiting, proposing nothing) for 2,
4, 8 ... steps as such misses repeat, up to speculative_max_pause; a proposal kept ends the back-off."""

from __future__ import annotations

from cluster.config import SchedulerConfig
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.draft import DraftProposer
from cluster.scheduler.grammars import accepted_prefix
from cluster.scheduler.ngram import propose_ngram
from cluster.scheduler.req import Req


class Speculator:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, draft: DraftProposer | None = None) -> None:
        """`draft`: the draft-model proposer (speculative_method draft); None: n-gram lookup."""
        self.cache, self.draft = cache, draft
        self.k, self.n_max = config.num_speculative_tokens, config.speculative_ngram_max
        self.max_step_tokens = config.max_extend_tokens
        self.max_batch = config.speculative_max_batch
        self.max_pause = config.speculative_max_pause
        self.num_draft_tokens = 0  # proposed, over every verify step
        self.num_accepted_tokens = 0  # of them, kept

    def active(self, num_running: int) -> bool:
        """Whether the next step speculates: only while few requests decode. Else no request waits for
        its own result, and every one decodes in the overlap loop."""
        return num_running <= self.max_batch

    def propose(self, decoding: list[Req]) -> list[list[int]] | None:
        """Each row's proposals ([] for a row that does not speculate or found none); None when no row
        has any (a plain decode step). The pages they need come from what the step leaves available."""
        caps = self._caps(decoding)
        if not any(caps):
            return None
        if self.draft is not None:
            drafts = self.draft.propose(decoding, caps)
        else:
            drafts = [propose_ngram(r.input_ids, k, self.n_max) if k else [] for r, k in zip(decoding, caps)]
        for req, k, d in zip(decoding, caps, drafts):
            if k and not d:  # looked up, found nothing
                self._missed(req)
        # a constrained row verifies only what its grammar allows: its proposals up to the first it rejects
        drafts = [self._grammatical(r, d) for r, d in zip(decoding, drafts)]
        return drafts if any(drafts) else None

    def _grammatical(self, req: Req, proposals: list[int]) -> list[int]:
        if not proposals or req.matcher is None:
            return proposals
        kept = proposals[: accepted_prefix(req.matcher, proposals)]
        if not kept and self.draft is not None:
            self.draft.accept(req, 1)  # a row with nothing to verify: the draft's KV past its input is void
        return kept

    def _caps(self, decoding: list[Req]) -> list[int]:
        """How many tokens each row may verify: within its max_tokens (the proposals and the token after
        them), short of its min_tokens while it is short of them (the stop-token ban is the row's), the
        step's token budget and the KV pages the step leaves available."""
        cache = self.cache
        pages = cache.available - sum(cache.extra_pages(r, r.cached_len + 1) for r in decoding)
        tokens = self.max_step_tokens - len(decoding)
        caps = []
        for req in decoding:
            k = min(self.k, req.max_device_len - len(req.input_ids) - 1, tokens) if req.speculates else 0
            if req.spec_pause:  # backing off: this step counts down its pause
                req.spec_pause -= 1
                k = 0
            if (out := len(req.input_ids) - req.prompt_len) < req.params.min_tokens:
                # every sample of the row still short of min_tokens, as the row's stop-token ban says
                k = min(k, req.params.min_tokens - out - 1)
            base = cache.extra_pages(req, req.cached_len + 1)
            while k > 0 and cache.extra_pages(req, req.cached_len + 1 + k) - base > pages:
                k -= 1
            k = max(k, 0)
            pages -= cache.extra_pages(req, req.cached_len + 1 + k) - base
            tokens -= k
            caps.append(k)
        return caps

    def accept(self, req: Req, num_drafts: int, num_new: int) -> None:
        """req's verify row proposed num_drafts tokens and keeps num_new samples (the accepted proposals
        and one more): its KV covers its input and the accepted ones; the rest is given back."""
        rejected = num_drafts + 1 - num_new
        req.verifying = False
        req.cached_len -= rejected
        req.device_len -= rejected
        self.cache.trim(req, req.cached_len)
        if self.draft is not None:
            self.draft.accept(req, num_new)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_new - 1
        if num_new > 1:
            req.spec_misses = 0
        else:
            self._missed(req)

    def _missed(self, req: Req) -> None:
        """req's proposals found nothing or were all rejected: it pauses twice as long as the last time."""
        if self.max_pause:
            req.spec_misses += 1
            req.spec_pause = min(2**req.spec_misses, self.max_pause)

    def release(self, req: Req) -> None:
        """req gave its pages and slot back (it ended or was preempted)."""
        req.verifying = False
        if self.draft is not None:
            self.draft.release(req)
