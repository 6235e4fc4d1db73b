"""The scheduler of one replica (tensor-parallel rank 0): takes requests from its inbox, builds each
step's batch (prefill.py admits and prefills, decode.py decodes and preempts), launches it on the
executor, and turns sampled tokens into per-request deltas. Two loops: `normal_step`
(launch, then emit its tokens) and `overlap_step` (launch step N+1, then emit step N's while it computes)."""

from __future__ import annotations

import logging
import queue
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from cluster.config import SchedulerConfig
from cluster.errors import ErrorKind, InvalidRequestError, RaylmError
from cluster.limits import RequestLimits, held_back_ids
from cluster.messages import (
    AbortRequest,
    AddRequest,
    CallBetweenSteps,
    FirstTokenHops,
    SchedulerStats,
    TokenDelta,
)
from cluster.sampling_params import SamplingParams
from cluster.scheduler.batch_builder import Batch, BatchBuilder
from cluster.scheduler.cache_manager import CacheManager
from cluster.scheduler.decode import DecodeManager
from cluster.scheduler.draft import DraftProposer
from cluster.scheduler.executor import Executor, ReplicaBrokenError
from cluster.scheduler.grammars import Grammars
from cluster.scheduler.prefill import PrefillManager
from cluster.scheduler.req import Req
from cluster.scheduler.request_slots import RequestSlots
from cluster.scheduler.spec_decode import Speculator
from worker.batch import StepOutput
from worker.sampling.verify import kept_counts

log = logging.getLogger(__name__)

# Under overlap, while at most this many requests are live, a step that ends a prompt is handled before
# the next step is scheduled (as the normal loop does): its first token would otherwise wait for the next
# step's launch (0.68 ms of the first token's 1.07 after the prompt's launch on an H200). A prompt step's
# launch is host-bound at low load, so the device is done with it by then and little overlap is lost.
FIRST_TOKEN_FIRST_MAX_LIVE = 4


@dataclass
class GrammarReady:
    """A constrained request's grammar has compiled, or its token mask been made (or failed to): `future`
    holds it."""

    uid: int
    future: Future


@dataclass
class Launched:
    """A step launched and not yet handled."""

    batch: Batch
    output: StepOutput

    @cached_property
    def rows(self) -> frozenset[int]:
        """The request slots it uses."""
        return frozenset(self.batch.desc.slots.tolist())

    @cached_property
    def req_set(self) -> frozenset[Req]:
        return frozenset(self.batch.reqs)

    @cached_property
    def row_tokens(self) -> dict[Req, int]:
        """The tokens each request's row computes (its input, and any proposals it verifies)."""
        return dict(zip(self.batch.reqs, self.batch.desc.extend_lens.tolist()))


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        *,
        num_pages: int,
        page_size: int,
        max_running_reqs: int,
        max_seq_len: int,
        eos_ids: set[int],
        on_output: Callable[[list[TokenDelta]], None],
        on_finish: Callable[[Req, str], None] | None = None,
        vocab_size: int | None = None,
        max_logit_bias: int | None = None,
        grammars: Grammars | None = None,
        draft: DraftProposer | None = None,
        sort_decode_rows: bool = False,
    ) -> None:
        """`vocab_size` and `max_logit_bias` (the engine's) bound what logit_bias may name; None: unchecked.
        `grammars` compiles and matches constrained requests; None: they are refused. `draft`: the
        draft-model proposer, with speculative_method draft. `sort_decode_rows`: a step's decoding rows
        longest KV first (Kernels.sorts_decode_rows)."""
        self.config, self.executor = config, executor
        self.max_seq_len, self.eos_ids = max_seq_len, frozenset(eos_ids)
        self.limits = RequestLimits(max_seq_len, vocab_size, max_logit_bias, self.eos_ids)
        self.grammars = grammars
        self.on_output = on_output
        self.on_finish = on_finish  # every request that ends, with its finish reason (metrics, tests)
        self.cache = CacheManager(num_pages, page_size, config.cache_type, config.decode_reserve_tokens)
        self.req_slots = RequestSlots(max_running_reqs)
        self.prefill = PrefillManager(self.cache, self.req_slots, config)
        self.decode = DecodeManager(self.cache, self.prefill, self._free, longest_first=sort_decode_rows)
        self.builder = BatchBuilder(self.cache, self.eos_ids, max_running_reqs, grammars)
        self.spec = Speculator(config, self.cache, draft) if config.speculative_method is not None else None
        self.reqs: dict[int, Req] = {}  # every live request, by uid
        self.finished_reqs: set[Req] = set()  # left the batch in flight: its result there is dropped
        # rows of the batch in flight launched as if the step before kept all its proposals, which it did
        # not (speculation's pipeline): dropped too
        self.voided: set[Req] = set()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: Launched | None = None
        self.steps = self.prefill_tokens = self.decode_tokens = self.mixed_steps = 0
        # aborts that arrived before their request (messages from several callers may reorder)
        self._early_aborts: OrderedDict[int, None] = OrderedDict()
        # constrained requests whose grammar is compiling: (deadline, the compile's future), by uid
        self._compiling: dict[int, tuple[float, Future]] = {}
        self.clock: Callable[[], float] = time.monotonic  # the grammars' deadlines' (tests step their own)

    # -- messages (thread-safe: anyone may call these) ---------------------------------------------

    def submit(self, request: AddRequest) -> None:
        self.inbox.put(request)

    def abort(self, uid: int) -> None:
        self.inbox.put(AbortRequest(uid))

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Runs fn on the loop's thread between two steps (where the state is consistent)."""
        call = CallBetweenSteps(fn)
        self.inbox.put(call)
        return call.future

    @property
    def has_work(self) -> bool:
        return bool(self.reqs) or self.in_flight is not None or not self.inbox.empty()

    def receive(self, block: bool = False) -> None:
        """Applies every message in the inbox; with `block`, waits up to 50 ms for the first."""
        if self._compiling:
            self._expire_grammars()
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return
            block = False
            match msg:
                case AddRequest():
                    self._add(msg)
                case AbortRequest(uid=uid):
                    self._abort(uid)
                case CallBetweenSteps():
                    msg.run()
                case GrammarReady():
                    self._grammar_ready(msg)

    def validate(self, input_ids: list[int], params: SamplingParams, output_len: int = 0) -> int:
        """Raises InvalidRequestError for a request this replica can never run; returns its maximum
        length (prompt plus new tokens, within the context). `output_len`: see AddRequest."""
        if output_len < 0 or (output_len and output_len >= len(input_ids)):  # an empty prompt: limits.check
            raise InvalidRequestError(
                f"output_len is {output_len}; it must leave a prompt of at least one of the {len(input_ids)} tokens"
            )
        n = len(input_ids) - output_len
        self.limits.check(input_ids[:n], params)
        self.limits.check_token_ids(input_ids[n:])  # a migrated request's output so far
        max_len = min(n + (params.max_tokens or self.max_seq_len), self.max_seq_len)
        need = self.cache.pages_for(max_len)
        if need > self.cache.num_pages:
            raise InvalidRequestError(
                f"the request needs {need} KV-cache pages (prompt {n} + up to {max_len - n} "
                f"new tokens) but the cache has {self.cache.num_pages}; lower max_tokens or shorten the prompt",
                field="max_tokens",
            )
        if params.n != 1:
            raise InvalidRequestError(
                "a scheduler runs one choice per request: fan n choices out first (cluster.fan_out)", field="n"
            )
        if params.grammar is not None and self.grammars is None:
            raise InvalidRequestError(
                "this replica cannot serve grammars (its model folder has no tokenizer)", field="response_format"
            )
        if params.token_masks and self.grammars is None:
            raise InvalidRequestError(
                "this replica cannot mask tokens (its model folder has no tokenizer)",
                field="allowed_token_ids" if params.allowed_token_ids is not None else "bad_words",
            )
        return max_len

    def _add(self, msg: AddRequest) -> None:
        if self._early_aborts.pop(msg.uid, 0) is None:
            return
        try:
            max_len = self.validate(msg.input_ids, msg.params, msg.output_len)
            if msg.uid in self.reqs:
                raise InvalidRequestError(f"request id {msg.uid} is already running")
            self.prefill.check_room(len(msg.input_ids))  # a full queue: OverloadedError
        except RaylmError as e:
            self.on_output([TokenDelta.failed_by(msg.uid, e)])
            return
        seed = msg.params.seed if msg.params.seed is not None else random.getrandbits(62)
        req = Req(msg.uid, list(msg.input_ids), msg.params, max_len, seed)  # its own list: tokens are appended
        if msg.received is not None:  # read off the channel before it reached the loop
            req.arrival = msg.received
        req.prompt_len -= msg.output_len  # a continued stream: its tokens so far are output, as after a preemption
        # every request may speculate: a verify sample's penalties count the proposals before it
        # (ProcessorState.apply), min_tokens keeps a verify row's samples on one side of its bound
        # (Speculator._caps), and a grammar's masks follow the proposals (Grammars.verify_masks)
        req.speculates = self.spec is not None
        req.pipelines = req.speculates and self.spec.pipelines(msg.params)
        if msg.after is not None:
            req.after = self.reqs.get(msg.after)
        self.reqs[req.uid] = req
        if req.constrained:  # it waits in the queue until its grammar is compiled or its token mask made
            if msg.params.grammar is not None:
                future = self.grammars.compile(msg.params.grammar)
            else:
                future = self.grammars.token_masks(msg.params, req.output_ids)
            self._compiling[req.uid] = (self.clock() + self.config.grammar_compile_timeout_s, future)
            future.add_done_callback(lambda future, uid=req.uid: self.inbox.put(GrammarReady(uid, future)))
        self.prefill.add(req)

    def _grammar_ready(self, msg: GrammarReady) -> None:
        req = self.reqs.get(msg.uid)
        if req is None or req.matcher is not None or msg.future.cancelled():
            return  # ended while its grammar compiled
        self._compiling.pop(msg.uid, None)
        try:
            matcher = self.grammars.matcher(msg.future.result())
            # a continued stream: its matcher is where the output so far has taken the grammar (a token
            # mask's was made there)
            grammar = req.params.grammar is not None
            if grammar and not all(matcher.accept_token(t) for t in req.output_ids):
                raise InvalidRequestError(
                    f"the output so far of request {req.uid} does not follow its {req.params.grammar.kind} grammar",
                    field="response_format",
                )
            req.matcher = matcher
        except RaylmError as e:
            self._end(req, "error")
            self.on_output([TokenDelta.failed_by(req.uid, e)])

    def _expire_grammars(self) -> None:
        """Fails each constrained request whose grammar has not compiled by its deadline: a grammar can take
        xgrammar minutes (a JSON schema of thousands of properties), and the request would wait for it."""
        now = self.clock()
        for uid in [uid for uid, (deadline, _) in self._compiling.items() if deadline <= now]:
            req, limit = self.reqs[uid], self.config.grammar_compile_timeout_s
            if req.params.grammar is not None:
                e = InvalidRequestError(
                    f"the request's {req.params.grammar.kind} grammar did not compile within {limit:g} s "
                    "(grammar_compile_timeout_s): simplify it (its compile goes on, and a request with the same "
                    "grammar after it finishes finds it compiled)",
                    field="response_format",
                )
            else:  # many thousands of bad words, or behind other requests' on the mask thread
                e = InvalidRequestError(
                    f"the request's bad_words were not made into a token mask within {limit:g} s "
                    "(grammar_compile_timeout_s): send fewer",
                    field="bad_words",
                )
            self._end(req, "error")
            self.on_output([TokenDelta.failed_by(uid, e)])

    def _abort(self, uid: int) -> None:
        req = self.reqs.get(uid)
        if req is not None:
            self._end(req, "abort")
            return
        self._early_aborts[uid] = None  # finished already, or not arrived yet
        if len(self._early_aborts) > 10_000:
            self._early_aborts.popitem(last=False)

    # -- ending a request ----------------------------------------------------------------------------

    def _end(self, req: Req, reason: str) -> None:
        """The one way a request ends, whether it finished, was aborted or failed."""
        del self.reqs[req.uid]
        req.ended = True
        if (compiling := self._compiling.pop(req.uid, None)) is not None:
            compiling[1].cancel()  # a compile that has not started never will; one running goes on (and is cached)
        if not self.decode.remove(req):
            self.prefill.remove(req)  # waiting, or part-way through a chunked prefill
        if req.slot >= 0:
            self._free(req)
        if self.on_finish is not None:
            self.on_finish(req, reason)

    def _free(self, req: Req) -> None:
        """Gives back a request's pages (its computed ones go to the prefix cache) and its request slot
        (released once the batch in flight is done); a result of it in that batch will be dropped."""
        self.cache.release(req, min(req.cached_len, len(req.input_ids)))
        if self.spec is not None:
            self.spec.release(req)
        self.req_slots.free(req.slot)
        req.slot = -1
        if self.in_flight is not None and req in self.in_flight.req_set:
            self.finished_reqs.add(req)

    # -- building a step ---------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """The next step. With mixed steps: every running decode, and beside them the prompt chunks that
        fit the token budget; else a prefill if any waiting request can be admitted, else a decode."""
        in_flight = self.in_flight.rows if self.in_flight is not None else frozenset()
        in_flight_reqs = self.in_flight.req_set if self.in_flight is not None else None
        # decided before choosing the rows: a speculating request then waits for its own result
        speculating = self.spec is not None and self.spec.active(len(self.decode.running))
        decoding: list[Req] = []
        budget = None
        if self.config.mixed_steps and self.decode.running:
            decoding = self.decode.schedule(in_flight_reqs, speculating)
            budget = self.config.max_extend_tokens - len(decoding)
        chosen = []
        if self.prefill.waiting and (budget is None or budget > 0):
            # admission leaves `headroom` pages free: the decode rows allocate theirs after it
            chosen = self.prefill.schedule(in_flight, self.decode.headroom, budget)
        if chosen:
            batch = self.builder.prefill(chosen, decoding)
            self._unknown_tails(decoding)
            for req, prompt_done in zip(batch.reqs[batch.num_decode :], batch.emits[batch.num_decode :]):
                if prompt_done:
                    req.tail = None  # its first token is in flight
                    self.decode.add(req)
            return batch
        if not self.config.mixed_steps:
            decoding = self.decode.schedule(in_flight_reqs, speculating)
        if not decoding:
            return None
        if not speculating:
            self._unknown_tails(decoding)
            return self.builder.decode(decoding)
        # proposals only in decode steps: a step with prompt chunks has given their pages out already
        batch = self.builder.decode(decoding, self.spec.propose(decoding))
        batch.speculating = True
        return batch

    def _unknown_tails(self, decoding: list[Req]) -> None:
        """Rows launched without proposals: what their requests' rows add is unknown until handled."""
        if self.spec is not None:
            for req in decoding:
                req.tail = None

    # -- the two loops -------------------------------------------------------------------------------

    def normal_step(self, block: bool = False) -> None:
        """Schedules step N, launches it, and handles its results before the next."""
        self.receive(block and self._idle)
        self.req_slots.release()  # nothing is in flight between two normal steps
        batch = self.schedule()
        if batch is not None and (launched := self._launch(batch)) is not None:
            self._emit_tokens(launched)

    def overlap_step(self, block: bool = False) -> None:
        """Schedules and launches step N+1, then handles step N's results while N+1 computes (a step
        that ends a prompt at low load is handled first: FIRST_TOKEN_FIRST_MAX_LIVE)."""
        last = self.in_flight  # step N
        self.receive(block and last is None and self._idle)  # aborts first: an aborted request's result is dropped
        if last is not None and self._first_tokens_first(last):
            self.in_flight = None  # nothing is in flight once it is handled: the normal loop's order
            self._emit_tokens(last)
            last = None
        if last is None:
            self.req_slots.release()  # nothing in flight can still write into a freed row
        batch = self.schedule()  # step N+1
        self.in_flight = self._launch(batch) if batch is not None else None
        if last is not None:
            self._emit_tokens(last)  # step N's tokens, while N+1 computes

    @property
    def _idle(self) -> bool:
        """Nothing to schedule until a message arrives: no live request, or each waits for its grammar to
        compile (the loop would otherwise spin beside the compiles until they end)."""
        return len(self._compiling) == len(self.reqs)

    def _first_tokens_first(self, launched: Launched) -> bool:
        """Whether a launched step ends some request's prompt while few requests are live."""
        batch = launched.batch
        return (
            batch.desc.is_prefill
            and len(self.reqs) <= FIRST_TOKEN_FIRST_MAX_LIVE
            and any(batch.emits[batch.num_decode :])
        )

    def step(self, block: bool = False) -> None:
        (self.overlap_step if self.config.overlap else self.normal_step)(block)

    def _launch(self, batch: Batch) -> Launched | None:
        desc = batch.desc
        self.steps += 1
        drafts = int(desc.spec_lens.sum()) if desc.spec_lens is not None else 0
        self.prefill_tokens += desc.num_tokens - batch.num_decode - drafts
        self.decode_tokens += batch.num_decode
        self.mixed_steps += desc.is_prefill and 0 < batch.num_decode < len(batch.reqs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d %s batch=%d tokens=%d running=%d waiting=%d free_pages=%d cached_pages=%d",
                self.steps,
                "prefill" if desc.is_prefill else "decode",
                desc.batch_size,
                desc.num_tokens,
                len(self.decode.running),
                len(self.prefill.waiting),
                self.cache.allocator.num_free,
                self.cache.prefix_cache.num_pages,
            )
        try:
            launched = Launched(batch, self.executor.launch(desc))
            if desc.is_prefill:  # for the first token's hops: where the prompt's launch ended
                now = time.perf_counter()
                for i in range(batch.num_decode, len(batch.reqs)):
                    if batch.emits[i]:
                        batch.reqs[i].prompt_launched = now
        except ReplicaBrokenError as e:
            self.fail_all(str(e), ErrorKind.REPLICA_DOWN)
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure fails this batch, not the replica
            log.exception("step failed")
            self.builder.failed(batch)
            self._fail(batch.reqs, f"the engine failed this step: {type(e).__name__}: {e}", ErrorKind.ENGINE)
            return None
        self.builder.launched()
        return launched

    def _emit_tokens(self, launched: Launched) -> None:
        """Waits for a step's sampled tokens, appends each to its request and sends them as deltas (one
        message for the step); ends the requests they finish."""
        batch, out = launched.batch, launched.output
        try:
            self.executor.wait(out)  # this step, and every one before it, is done on the device
        except ReplicaBrokenError as e:
            self.fail_all(str(e), ErrorKind.REPLICA_DOWN)
            raise
        self.req_slots.release()
        stale, self.finished_reqs = self.finished_reqs, set()
        void, self.voided = self.voided, set()
        later = self.in_flight  # the step launched after this one (the overlap loop)
        tokens = out.next_tokens.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        if batch.scored:
            self._keep_prompt_logprobs(batch, out, stale)
        now = time.perf_counter()
        deltas: list[TokenDelta] = []
        spec = batch.desc.spec_lens.tolist() if batch.desc.spec_lens is not None else None
        num_new = kept_counts(tokens, spec, batch.desc.input_ids) if spec is not None else None
        first = 0  # where the row's samples start (one a row, but spec_len + 1 in a verify step)
        emitted = 0
        for i, req in enumerate(batch.reqs):
            start, count = (first, num_new[i]) if spec is not None else (i, 1)
            first += spec[i] + 1 if spec is not None else 1
            if req in stale or req in void or not batch.emits[i]:
                continue  # a result of a request that left the batch, of a void row, or of a mid-prompt chunk
            emitted += count
            if self.spec is not None and (later is None or req not in later.req_set):
                req.tail = []  # nothing of it is in flight
            if spec is not None and spec[i]:
                voided = self._void_later(req, later, kept_all=count > spec[i])
                self.spec.accept(req, spec[i], count, voided, last=tokens[start + count - 1])
            for j in range(start, start + count):
                if self._emit_one(req, tokens[j], j, out, logprobs, now, deltas):
                    break
            else:
                if batch.desc.is_prefill and self.cache.cache_prefix(req, req.fill_len):
                    self.builder.rewrite_slots[req.slot] = req
        if self.spec is not None:
            decode_only = batch.num_decode == len(batch.reqs)
            self.spec.handled(now, batch.speculating if decode_only else None, len(batch.reqs), emitted)
        if deltas:
            self.on_output(deltas)

    def _void_later(self, req: Req, later: Launched | None, kept_all: bool) -> int:
        """req's row in the step in flight, if it has one, was launched as if this step kept all of req's
        proposals (speculation's pipeline): where this one kept fewer, that row is void (its result is
        dropped when handled). Returns the tokens it computes, to be given back with the rejected ones."""
        n = later.row_tokens.get(req, 0) if later is not None else 0
        if not n:
            return 0
        self.spec.num_pipelined_rows += 1
        if kept_all:
            return 0
        self.voided.add(req)
        return n

    def _emit_one(
        self, req: Req, token: int, j: int, out: StepOutput, logprobs: list[float] | None, now: float, deltas: list
    ) -> bool:
        """Appends one sampled token (sample j of the step) to req and its delta to `deltas`; True when
        req ended with it (or failed on it), so that no later sample of it counts."""
        # every token of a constrained request passes its matcher first, EOS included (the grammar
        # must be complete for it): one the grammar rejects fails the request, and never reaches it
        if req.matcher is not None and (self._held_back(req, token) or not req.matcher.accept_token(token)):
            kind, why, field = self._grammar_failure(req, token)
            log.error("request %d: %s", req.uid, why)
            self._end(req, "error")
            deltas.append(TokenDelta.failure(req.uid, kind, why, field))
            return True
        req.input_ids.append(token)
        req.first_token = req.first_token or now
        req.last_token = now
        delta = TokenDelta(req.uid, token)
        if len(req.input_ids) == req.prompt_len + 1:  # its first token
            delta.cached_tokens = req.prefix_hit_len
            launched = req.prompt_launched or now
            delta.hops = FirstTokenHops(
                req.scheduled - req.arrival,
                launched - req.scheduled,
                first_sample_s=now - launched,
                sampled_at=now,
            )
            if req.params.prompt_logprobs is not None:
                delta.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
        if logprobs is not None and req.params.logprobs is not None:
            delta.logprob = logprobs[j]
            if k := req.params.logprobs:
                delta.top_logprobs = list(zip(out.top_ids[j, :k].tolist(), out.top_logprobs[j, :k].tolist()))
        # judged by tokens received: req.device_len is already a step ahead under overlap
        if (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
            delta.finished, delta.finish_reason = True, "stop"
        elif req.matcher is not None and req.matcher.is_terminated():
            delta.finished, delta.finish_reason = True, "stop"  # the output is whole: nothing may follow
        elif len(req.input_ids) >= req.max_device_len:
            delta.finished, delta.finish_reason = True, "length"
        deltas.append(delta)
        if delta.finished:
            self._end(req, delta.finish_reason)
        return delta.finished

    def _keep_prompt_logprobs(self, batch: Batch, out: StepOutput, stale: set[Req]) -> None:
        """Appends each scored request's prompt logprobs of this step (sent with its first token)."""
        values = out.prompt_logprobs.tolist()
        top_ids = out.prompt_top_ids.tolist() if out.prompt_top_ids is not None else None
        top_values = out.prompt_top_logprobs.tolist() if out.prompt_top_logprobs is not None else None
        for req, start, count in batch.scored:
            if req in stale:
                continue
            k = req.params.prompt_logprobs
            for i in range(start, start + count):
                top = list(zip(top_ids[i][:k], top_values[i][:k])) if k and top_ids is not None else []
                req.prompt_logprobs.append((values[i], top))

    # -- failure -------------------------------------------------------------------------------------

    def _fail(self, reqs: list[Req], why: str, kind: ErrorKind) -> None:
        for req in reqs:
            if self.reqs.get(req.uid) is req:
                self._end(req, "error")
        self.on_output([TokenDelta.failure(r.uid, kind, why) for r in reqs])

    def fail_all(self, why: str, kind: ErrorKind = ErrorKind.ENGINE) -> None:
        """Ends every live request with an error of this kind."""
        self.in_flight = None
        self.receive(block=False)
        self._fail(list(self.reqs.values()), why, kind)

    # -- checks --------------------------------------------------------------------------------------

    def snapshot(self) -> SchedulerStats:
        """Counts an operator (or a test) wants to see."""
        cache, slots = self.cache, self.req_slots
        return SchedulerStats(
            running=len(self.decode.running),
            waiting=len(self.prefill.waiting),
            live=len(self.reqs),
            request_slots_total=slots.num_slots,
            request_slots_free=slots.available + slots.num_unreleased,
            pages_total=cache.num_pages,
            pages_free=cache.allocator.num_free,
            pages_cached=cache.prefix_cache.num_pages,
            pages_reserved=cache.reserved,
            prefix_hit_tokens=cache.prefill_tokens_saved,
            prompt_tokens_admitted=cache.prompt_tokens_admitted,
            steps=self.steps,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            preempted=self.decode.num_preempted,
            mixed_steps=self.mixed_steps,
            queued_tokens=self.prefill.queued_tokens,
            oldest_wait_s=max((time.perf_counter() - r.arrival for r in self.prefill.waiting), default=0.0),
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens if self.spec is not None else 0,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens if self.spec is not None else 0,
        )

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every KV page is free, prefix-cached or held by a live request."""
        self.cache.check_integrity([r for r in self.reqs.values() if r.slot >= 0])

    def _held_back(self, req: Req, token: int) -> bool:
        """A token min_tokens holds back, sampled short of min_tokens: the step's mask left nothing else
        (every token at -inf draws token 0)."""
        short = len(req.input_ids) - req.prompt_len < req.params.min_tokens
        return short and token in held_back_ids(req.params, self.eos_ids)

    def _grammar_failure(self, req: Req, token: int) -> tuple[ErrorKind, str, str | None]:
        """Why a constrained request cannot take `token`, and the field at fault: where its grammar (or
        mask) allows no token, or only tokens that its min_tokens holds back, no output follows (the
        caller's to change); else a server fault."""
        p = req.params
        bits = np.unpackbits(self.grammars.masks([req.matcher])[0].view(np.uint8), bitorder="little")
        allowed = set(np.flatnonzero(bits[: self.grammars.vocab_size]).tolist())
        if not allowed:
            return (
                ErrorKind.INVALID_REQUEST,
                f"{_constraint(req)} allows no token after {len(req.output_ids)} output tokens: no output "
                + ("follows it (a grammar or regular expression that matches nothing)" if p.grammar else "is left"),
                _constraint_field(req),
            )
        if len(req.output_ids) < p.min_tokens and allowed <= set(held_back_ids(p, self.eos_ids)):
            return (
                ErrorKind.INVALID_REQUEST,
                f"{_constraint(req)} allows only a stop token after "
                f"{len(req.output_ids)} output tokens, which min_tokens ({p.min_tokens}) holds back: "
                "no output satisfies both; lower min_tokens or allow other tokens",
                "min_tokens",
            )
        return ErrorKind.ENGINE, _rejected(req, token), None


def _constraint(req: Req) -> str:
    """What constrains a request's tokens, for its errors."""
    p = req.params
    if p.grammar is not None:
        return f"the request's {p.grammar.kind} grammar"
    named = [name for name in ("allowed_token_ids", "bad_words") if getattr(p, name)]
    return f"the request's {' and '.join(named)}"


def _constraint_field(req: Req) -> str:
    """The request field of what constrains its tokens."""
    p = req.params
    return "response_format" if p.grammar is not None else "allowed_token_ids" if p.allowed_token_ids else "bad_words"


def _rejected(req: Req, token: int) -> str:
    return (
        f"{_constraint(req)} rejected the sampled token {token} (its mask "
        "should have forbidden it: a server fault); the output was stopped rather than returned broken"
    )
