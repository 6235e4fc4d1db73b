"""Turning the requests chosen for a step into its batch description: allocating the KV pages the
step writes and advancing each request's state at launch (what lets the overlap loop schedule step
N+1 before step N's tokens are known)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from cluster.limits import held_back_ids
from cluster.sampling_params import SamplingParams
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.grammars import Grammars
from cluster.scheduler.req import Req
from worker.batch import BatchDesc
from worker.sampling.processors import ProcessorInit, ProcessorRows


@dataclass
class Batch:
    """A step as the scheduler sees it: its description, and its requests in the description's order."""

    desc: BatchDesc
    reqs: list[Req]
    emits: list[bool]  # False for a chunk that does not end its prompt: its sample is meaningless
    # prompt logprobs: (request, where its scored positions start in desc.plp_idx, how many)
    scored: list[tuple[Req, int, int]] = field(default_factory=list)
    num_decode: int = 0  # the first rows that decode (all of a decode step's; a mixed step's before its prompts)
    speculating: bool = False  # a decode step scheduled while speculation was on (its rows may wait on it)


class BatchBuilder:
    def __init__(
        self, cache: CacheManager, eos_ids: frozenset[int], scratch_row: int, grammars: Grammars | None = None
    ) -> None:
        """`eos_ids`: what min_tokens holds back with the stop ids; `scratch_row`: the processor-state row
        of rows that use no processors (the number of request slots); `grammars`: builds constrained
        rows' masks."""
        self.cache = cache
        self.eos_ids, self.scratch_row = eos_ids, scratch_row
        self.grammars = grammars
        # request slots whose page-table row changed on the host, written by the next step
        self.rewrite_slots: dict[int, Req] = {}

    def prefill(
        self, chosen: list[tuple[Req, int]], decoding: list[Req] | tuple = (), drafts: list[list[int]] | None = None
    ) -> Batch:
        """A prefill step over (request, tokens to compute) pairs; with `decoding`, a mixed step whose
        first rows decode those requests (one token each, read from the token pool on the device: the
        host may not know it yet), so that no running decode waits for a prompt. With `drafts` (one list
        per decoding row), those rows also compute the tokens proposed for them, to verify them."""
        reqs, emits, ids, locs, seq_lens, inits, scored = [], [], [], [], [], [], []
        plp_idx, plp_target = [], []
        if decoding:
            decode_locs, decode_lens = self._decode_rows(decoding, drafts)
            reqs, emits, seq_lens = list(decoding), [True] * len(decoding), decode_lens
            locs = [decode_locs]
            if drafts is None:
                ids = [[-1]] * len(decoding)  # -1: the input is in the token pool
            else:
                ids = [[-1, *d] for d in drafts]
        offset = sum(len(x) for x in ids)
        for req, ext in chosen:
            start, end = req.cached_len, req.cached_len + ext
            self.cache.allocate(req, end)
            if start == req.prefix_hit_len and start > 0:
                self.rewrite_slots[req.slot] = req
            if start == req.prefix_hit_len and req.params.uses_processors:
                inits.append(self._init(req))
            if req.scores_prompt:
                # position p scores prompt token p + 1; the prompt's last position samples instead
                upto = min(end, req.prompt_len - 1)
                if upto > start:
                    scored.append((req, sum(len(x) for x in plp_idx), upto - start))
                    plp_idx.append(np.arange(offset, offset + upto - start, dtype=np.int32))
                    plp_target.append(np.asarray(req.input_ids[start + 1 : upto + 1], dtype=np.int32))
            offset += ext
            if req.scheduled is None:
                req.scheduled = time.perf_counter()
            ids.append(req.input_ids[start:end])
            locs.append(self.cache.locations(req, start, end))
            seq_lens.append(end)
            req.cached_len = end
            done = end == req.fill_len
            if done:  # the prompt's last token samples the first output token (the next, after a preemption)
                req.device_len = req.fill_len + 1
            reqs.append(req)
            emits.append(done)
        desc = self._desc(
            True,
            reqs,
            seq_lens,
            [len(x) for x in ids],
            np.concatenate(locs),
            np.fromiter((t for x in ids for t in x), dtype=np.int32),
            emits,
        )
        desc.proc_init = inits
        if drafts is not None:
            desc.spec_lens = np.asarray([len(d) for d in drafts] + [0] * len(chosen), dtype=np.int32)
            if desc.grammar_rows is not None:
                self._verify_masks(desc, reqs, drafts)
        if scored:
            desc.plp_idx, desc.plp_target = np.concatenate(plp_idx), np.concatenate(plp_target)
            desc.prompt_logprobs = max(r.params.prompt_logprobs for r, _, _ in scored)
        return Batch(desc, reqs, emits, scored, num_decode=len(decoding))

    def _init(self, req: Req) -> ProcessorInit:
        """req's processor state from scratch: its prompt (for the repetition penalty), its tokens so far
        (after a preemption) and its sparse entries: biases, then the ids min_tokens holds back."""
        p = req.params
        stops = self.stop_ids(p) if p.min_tokens > len(req.output_ids) else []
        bias_ids = list(p.logit_bias)
        return ProcessorInit(
            slot=req.slot,
            prompt_ids=np.asarray(req.input_ids[: req.prompt_len] if p.repetition_penalty != 1 else [], dtype=np.int32),
            output_ids=np.asarray(req.output_ids, dtype=np.int32),
            sparse_ids=np.asarray(bias_ids + stops, dtype=np.int32),
            sparse_bias=np.asarray([p.logit_bias[t] for t in bias_ids] + [0.0] * len(stops), dtype=np.float32),
            sparse_ban=np.asarray([0] * len(bias_ids) + [1] * len(stops), dtype=np.uint8),
        )

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that would end a request's output: EOS (unless ignored) and its stop ids."""
        return held_back_ids(params, self.eos_ids)

    def decode(self, reqs: list[Req], drafts: list[list[int]] | None = None) -> Batch:
        """A decode step; with `drafts` (one list per row), an extend step that verifies them."""
        if drafts is not None:
            return self.prefill([], reqs, drafts)
        locs, seq_lens = self._decode_rows(reqs)
        emits = [True] * len(reqs)
        return Batch(
            self._desc(False, reqs, seq_lens, [1] * len(reqs), locs, None, emits), reqs, emits, num_decode=len(reqs)
        )

    def _decode_rows(self, reqs: list[Req], drafts: list[list[int]] | None = None) -> tuple[np.ndarray, list[int]]:
        """Each request's next position (and with `drafts`, those of its proposals after it): their KV
        locations (pages allocated where they start one) and its length once the step is done;
        advances the requests at launch, as if every proposal were kept (until its result says)."""
        if drafts is not None:
            locs = []
            seq_lens = []
            for req, d in zip(reqs, drafts):
                pos, n = req.cached_len, 1 + len(d)
                self.cache.allocate(req, pos + n)
                locs.append(self.cache.locations(req, pos, pos + n))
                req.cached_len += n
                req.device_len += n
                req.verifying = bool(d)
                seq_lens.append(req.cached_len)
            return np.concatenate(locs), seq_lens
        locs = np.empty(len(reqs), dtype=np.int32)
        seq_lens = []
        for i, req in enumerate(reqs):
            pos = req.cached_len
            self.cache.allocate(req, pos + 1)
            page = req.pages[pos // self.cache.page_size]
            locs[i] = page * self.cache.page_size + pos % self.cache.page_size
            req.cached_len += 1
            req.device_len += 1
            seq_lens.append(req.cached_len)
        return locs, seq_lens

    def launched(self) -> None:
        """The last batch built reached the device, and with it the page-table rows it rewrote."""
        self.rewrite_slots.clear()

    def failed(self, batch: Batch) -> None:
        """The last batch built never ran: its requests' KV for this step was not computed, so none of
        it may reach the prefix cache when they are freed (its rewrites stay pending for the next step)."""
        for req, seq_len, ext in zip(batch.reqs, batch.desc.seq_lens.tolist(), batch.desc.extend_lens.tolist()):
            req.cached_len = seq_len - ext

    def _desc(
        self,
        is_prefill: bool,
        reqs: list[Req],
        seq_lens: list[int],
        extend_lens: list[int],
        out_loc: np.ndarray,
        input_ids: np.ndarray | None,
        emits: list[bool],
    ) -> BatchDesc:
        params = [r.params for r in reqs]
        n = len(reqs)
        # a request that has left its row since (ended or preempted) needs no rewrite
        rows = [
            (slot, self.cache.locations(r, 0, r.num_cached_pages * self.cache.page_size))
            for slot, r in self.rewrite_slots.items()
            if r.slot == slot
        ]
        want = [p.logprobs for p in params if p.logprobs is not None]
        # constrained rows whose sample is kept: their masks, from their matchers' state now (every token
        # they produced so far has been handled: the scheduler keeps them out of the step after their last)
        extras = any(r.sampling_extras for r in reqs)  # else none of the scans below can find anything
        constrained = (
            [i for i, (r, emit) in enumerate(zip(reqs, emits)) if r.matcher is not None and emit] if extras else []
        )
        desc = BatchDesc(
            is_prefill=is_prefill,
            slots=np.fromiter((r.slot for r in reqs), dtype=np.int32, count=len(reqs)),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            extend_lens=np.asarray(extend_lens, dtype=np.int32),
            out_loc=out_loc,
            input_ids=input_ids,
            temperature=np.fromiter((p.temperature for p in params), dtype=np.float32, count=len(reqs)),
            top_p=np.fromiter((p.top_p for p in params), dtype=np.float32, count=len(reqs)),
            top_k=np.fromiter((p.top_k for p in params), dtype=np.int32, count=len(reqs)),
            seeds=np.fromiter((r.seed for r in reqs), dtype=np.int64, count=len(reqs)),
            prefix_slots=rows,
            top_logprobs=max(want) if want else -1,
            min_p=np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
            if extras and any(p.min_p > 0 for p in params)
            else None,
            procs=self._procs(reqs, seq_lens, emits)
            if extras and (constrained or any(p.uses_processors for p in params))
            else None,
        )
        if constrained:
            desc.grammar_rows = np.asarray(constrained, dtype=np.int32)
            desc.grammar_mask = self.grammars.masks([reqs[i].matcher for i in constrained])
        return desc

    def _verify_masks(self, desc: BatchDesc, reqs: list[Req], drafts: list[list[int]]) -> None:
        """A verify step's grammar rows are its samples (spec_len + 1 a row, in row order), each masked by
        its grammar's state after the proposals before it in its row."""
        n = desc.spec_lens.astype(np.int64) + 1
        row_start = np.cumsum(n) - n
        rows = desc.grammar_rows.tolist()
        proposals = [drafts[i] if i < len(drafts) else [] for i in rows]
        desc.grammar_rows = np.concatenate([row_start[i] + np.arange(n[i]) for i in rows]).astype(np.int32)
        desc.grammar_mask = self.grammars.verify_masks([(reqs[i].matcher, p) for i, p in zip(rows, proposals)])

    def _procs(self, reqs: list[Req], seq_lens: list[int], emits: list[bool]) -> ProcessorRows:
        """Per-row processor arguments. A row reads and counts into its request's slot only when its
        request uses processors and its sample is kept (not a mid-prompt chunk's)."""
        n = len(reqs)
        rows = ProcessorRows.idle(n, self.scratch_row)
        for i, (req, seq_len, emit) in enumerate(zip(reqs, seq_lens, emits)):
            p = req.params
            if not (p.uses_processors and emit):
                continue
            rows.state_row[i] = req.slot
            rows.presence[i], rows.frequency[i], rows.repetition[i] = (
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            )
            # this step samples output token number seq_len - prompt_len (from 0)
            rows.ban_stop[i] = seq_len - req.prompt_len < p.min_tokens
        return rows
