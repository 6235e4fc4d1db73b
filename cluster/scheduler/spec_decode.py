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

With speculative_pipeline (n-gram or a draft model, the overlap loop), a request without penalties,
biases or a grammar does not wait for its verify step in flight: its next row launches meanwhile, as if
that step kept every proposal. It takes that bet only while its last handled verify step kept every
proposal (after one that kept fewer, the bet would likely lose: it waits). Its proposals then continue
from its tail (Req.tail): the last row's proposals and the token the lookup (or the draft) expects after
them, asked for with them (a lookup of k + 1 tokens; a draft drafts k + 1). An EAGLE-3 head does not
pipeline: its next row needs the model's hidden states of the row in flight. Those are proposals like
any other, so a wrong guess costs only acceptance; but where the last step keeps fewer than all, the row
launched after it stands on positions that were not kept: the scheduler voids it (its samples are
dropped, its KV given back with the rejected positions'). The token pool stays right for the next row:
the void row wrote only past every position the earlier step could keep. Sampling is a function of
(seed, position), so a void row leaves no trace in what is sampled later.

Waiting costs the overlap: the host's work between two of the request's steps leaves the device idle.
So a request whose proposals do not pay backs off: after a row whose lookup found nothing, or whose
proposals were all rejected, it decodes in the overlap loop (not waiting, proposing nothing) for 2,
4, 8 ... steps as such misses repeat, up to speculative_max_pause; a proposal kept ends the back-off."""

from __future__ import annotations

import logging

from cluster.config import SchedulerConfig
from cluster.sampling_params import SamplingParams
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.draft import DraftProposer
from cluster.scheduler.grammars import accepted_prefix
from cluster.scheduler.ngram import propose_ngram
from cluster.scheduler.req import Req
from cluster.scheduler.spec_gate import SpecGate

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, draft: DraftProposer | None = None) -> None:
        """`draft`: the draft-model proposer (speculative_method draft); None: n-gram lookup."""
        self.cache, self.draft = cache, draft
        self.k, self.n_max = config.num_speculative_tokens, config.speculative_ngram_max
        self.max_step_tokens = config.max_extend_tokens
        self.max_batch = config.speculative_max_batch
        self.max_pause = config.speculative_max_pause
        self.pipeline = config.speculative_pipeline and config.overlap
        self.gate = SpecGate() if config.speculative_adaptive else None
        # a draft that reads as many bytes a forward as the model cannot pay at any acceptance: the gate
        # keeps speculation off without probing it (each probe would cost the draft's catch-up)
        self.never_pays = self.gate is not None and draft is not None and draft.relative_cost >= 1.0
        if self.never_pays:
            log.warning(
                "the draft model reads %.2fx the bytes of the model a forward: speculation cannot pay and stays "
                "off (speculative_adaptive false runs it anyway)",
                draft.relative_cost,
            )
        self.num_draft_tokens = 0  # proposed, over every verify step
        self.num_accepted_tokens = 0  # of them, kept
        # rows launched while the last verify step of their request was in flight (counted when it is handled)
        self.num_pipelined_rows = 0
        self.num_void_rows = 0  # of them, void: that step kept fewer than all

    def pipelines(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters speculates in the pipeline: n-gram lookup, the overlap
        loop, and nothing whose state on the host or device a void row would disturb (penalties, biases
        and min_tokens count samples into processor state; a grammar's matcher, and bad words', takes each
        token)."""
        return (
            self.pipeline
            and (self.draft is None or self.draft.pipelines)
            and not params.uses_processors
            and params.grammar is None
            and not params.bad_words
        )

    def active(self, num_running: int) -> bool:
        """Whether the next step speculates: only while few requests decode, and (speculative_adaptive)
        while speculating measures faster than not (spec_gate.py). Else no request waits for its own
        result, and every one decodes in the overlap loop."""
        if num_running > self.max_batch or self.never_pays:
            return False
        return self.gate is None or self.gate.speculates(num_running)

    def handled(self, now: float, speculated: bool | None, rows: int, tokens: int) -> None:
        """A step's results were handled at `now` (SpecGate.handled)."""
        if self.gate is not None:
            self.gate.handled(now, speculated, rows, tokens)

    def propose(self, decoding: list[Req]) -> list[list[int]] | None:
        """Each row's proposals ([] for a row that does not speculate or found none); None when no row
        has any (a plain decode step). The pages they need come from what the step leaves available."""
        caps = self._caps(decoding)
        if not any(caps):
            for req in decoding:
                req.tail = None
            return None
        if self.draft is not None:
            drafts = self._draft(decoding, caps)
        else:
            drafts = [self._lookup(r, k) for r, k in zip(decoding, caps)]
        for req, k, d in zip(decoding, caps, drafts):
            if k and not d:  # looked up, found nothing
                self._missed(req)
        # a constrained row verifies only what its grammar allows: its proposals up to the first it rejects
        drafts = [self._grammatical(r, d) for r, d in zip(decoding, drafts)]
        return drafts if any(drafts) else None

    def _lookup(self, req: Req, k: int) -> list[int]:
        """Up to k proposals for req's row by n-gram lookup, after its tail when its last row is in flight;
        in the pipeline, its new tail: those proposals and the token looked up after them (None when the
        lookup has none: req then waits for this row's result before it speculates again)."""
        if not k:
            req.tail = None
            return []
        if not req.pipelines:
            return propose_ngram(req.input_ids, k, self.n_max)
        found = propose_ngram(req.input_ids + req.tail if req.tail else req.input_ids, k + 1, self.n_max)
        req.tail = found if len(found) > k else None
        return found[:k]

    def _draft(self, decoding: list[Req], caps: list[int]) -> list[list[int]]:
        """Each row's proposals by the draft model; in the pipeline, drafted on from its tail when its last
        row is in flight, one more drafted after them: its guess of the row's last sample, which makes its
        new tail with them (None where the draft gave fewer)."""
        wants, after = [], []
        for req, k in zip(decoding, caps):
            piped = bool(k) and req.pipelines
            wants.append(k + 1 if piped else k)
            after.append(req.input_ids + req.tail if piped and req.tail else req.input_ids)
        found = self.draft.propose(decoding, wants, after, caps)
        for req, k, f in zip(decoding, caps, found):
            if req.pipelines:
                req.tail = f if k and len(f) > k else None
        return [f[:k] for f, k in zip(found, caps)]

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
            # within max_tokens from its length on the device (past its tokens in flight, in the pipeline)
            k = min(self.k, req.max_device_len - req.device_len - 1, tokens) if req.speculates else 0
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

    def accept(self, req: Req, num_drafts: int, num_new: int, void: int = 0, last: int | None = None) -> None:
        """req's verify row proposed num_drafts tokens and keeps num_new samples (the accepted proposals
        and one more, `last`): its KV covers its input and the accepted ones; the rest is given back, and
        with them the `void` tokens of its row launched after this one (in the pipeline), void since this
        one kept fewer than all."""
        rejected = num_drafts + 1 - num_new + void
        req.kept_all = not rejected
        if void:
            req.tail = []  # nothing of it in flight counts now
            self.num_void_rows += 1
        req.verifying = False
        req.cached_len -= rejected
        req.device_len -= rejected
        self.cache.trim(req, req.cached_len)
        if self.draft is not None:
            self.draft.accept(req, num_new, last, void=bool(void))
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
        req.tail = []
        if self.draft is not None:
            self.draft.release(req)
