"""The scheduler of one replica (tensor-parallel rank 0): builds each step's batch, launches it on the
engine(s), and turns sampled tokens into per-request deltas. Two loops: `normal_step` (launch, then
handle) and `overlap_step` (launch step N+1, then handle step N while it computes)."""

from __future__ import annotations

import logging
import queue
import random
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

from cluster.batch_builder import BatchBuilder
from cluster.cache_manager import CacheManager
from cluster.config import SchedulerConfig
from cluster.errors import ErrorKind, InvalidRequestError
from cluster.executor import ReplicaBrokenError
from cluster.messages import TokenDelta
from cluster.prefill import PrefillManager
from cluster.req import Req
from cluster.sampling_params import SamplingParams
from cluster.slot_table import SlotTable
from worker.batch import BatchDesc, StepOutput

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs a batch description on every rank of the replica; returns rank 0's output."""

    def launch(self, desc: BatchDesc) -> StepOutput: ...

    def wait(self, out: StepOutput) -> None:
        """Returns once `out` has reached the host; raises ReplicaBrokenError if it never can."""


@dataclass
class Launched:
    desc: BatchDesc
    reqs: list[Req]
    emits: list[bool]  # False for a chunk that does not end its prompt: its sample is meaningless
    output: StepOutput

    @property
    def slots(self) -> frozenset[int]:
        return frozenset(self.desc.table_idx.tolist())


@dataclass
class AddRequest:
    uid: int
    input_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    uid: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, executor: Executor, *, num_pages: int, page_size: int,
                 max_running_reqs: int, max_seq_len: int, eos_ids: set[int],
                 on_output: Callable[[list[TokenDelta]], None],
                 on_finish: Callable[[Req, str], None] | None = None) -> None:
        self.config, self.executor = config, executor
        self.max_seq_len, self.eos_ids = max_seq_len, frozenset(eos_ids)
        self.on_output = on_output
        self.on_finish = on_finish  # every request that ends (for metrics), with its finish reason
        self.cache = CacheManager(num_pages, page_size, config.cache_type, config.decode_reserve_tokens)
        self.slots = SlotTable(max_running_reqs)
        self.prefill = PrefillManager(self.cache, self.slots, config.max_extend_tokens)
        self.running: dict[int, Req] = {}       # decoding, by uid
        self.reqs: dict[int, Req] = {}          # every live request, by uid
        self.finished_reqs: set[Req] = set()    # ended while a batch holding them may be in flight
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: Launched | None = None
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "preempted": 0}
        self.builder = BatchBuilder(self.cache, self.stats)
        # aborts that arrived before their request (messages from several callers may reorder)
        self._early_aborts: OrderedDict[int, None] = OrderedDict()

    # -- messages (thread-safe: anyone may call these) ---------------------------------------------

    def submit(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        self.inbox.put(AddRequest(uid, list(input_ids), params))

    def abort(self, uid: int) -> None:
        self.inbox.put(AbortRequest(uid))

    def call_between_steps(self, fn: Callable[[], object]) -> Future:
        """Runs fn on the loop's thread between two steps (where the state is consistent)."""
        future: Future = Future()
        self.inbox.put((fn, future))
        return future

    @property
    def has_work(self) -> bool:
        return bool(self.reqs) or self.in_flight is not None or not self.inbox.empty()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg.uid)
            else:
                fn, future = msg
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def _add(self, msg: AddRequest) -> None:
        if self._early_aborts.pop(msg.uid, 0) is None:
            return
        try:
            req = self._make_req(msg)
        except InvalidRequestError as e:
            self.on_output([TokenDelta.failure(msg.uid, ErrorKind.INVALID_REQUEST, str(e))])
            return
        self.reqs[req.uid] = req
        self.prefill.add(req)

    def validate(self, input_ids: list[int], params: SamplingParams) -> int:
        """Raises InvalidRequestError for a request this replica can never run; returns its maximum
        length (prompt plus new tokens, within the context)."""
        n = len(input_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_seq_len:
            raise InvalidRequestError(f"the prompt has {n} tokens; this model's context is {self.max_seq_len} "
                                      f"tokens, which must hold the prompt and at least one new token")
        max_len = min(n + (params.max_tokens or self.max_seq_len), self.max_seq_len)
        need = self.cache.pages_for(max_len)
        if need > self.cache.num_pages:
            raise InvalidRequestError(f"the request needs {need} KV-cache pages (prompt {n} + up to {max_len - n} "
                                      f"new tokens) but the cache has {self.cache.num_pages}; lower max_tokens or shorten the prompt")
        return max_len

    def _make_req(self, msg: AddRequest) -> Req:
        max_len = self.validate(msg.input_ids, msg.params)
        if msg.uid in self.reqs:
            raise InvalidRequestError(f"request id {msg.uid} is already running")
        seed = msg.params.seed if msg.params.seed is not None else random.getrandbits(62)
        return Req(msg.uid, msg.input_ids, msg.params, max_len, seed)

    def _abort(self, uid: int, reason: str = "abort") -> None:
        req = self.reqs.get(uid)
        if req is None:  # finished already, or not arrived yet
            self._early_aborts[uid] = None
            if len(self._early_aborts) > 10_000:
                self._early_aborts.popitem(last=False)
            return
        if req in self.prefill.waiting:
            self.prefill.remove(req)
        self.running.pop(uid, None)
        if req.table_idx >= 0:
            self._free(req)
            # its prefill or decode may be in flight: that result must be dropped, not handled
            self.finished_reqs.add(req)
        self.reqs.pop(uid)
        if self.on_finish is not None:
            self.on_finish(req, reason)

    def _free(self, req: Req) -> None:
        self.cache.release(req, min(req.cached_len, len(req.input_ids)))
        self.builder.rewrite_rows.pop(req.table_idx, None)
        self.slots.free(req.table_idx)
        req.table_idx = -1

    # -- building a step ---------------------------------------------------------------------------

    def schedule(self) -> tuple[BatchDesc, list[Req], list[bool]] | None:
        in_flight = self.in_flight.slots if self.in_flight is not None else frozenset()
        # a page each for running requests past their reservation: admitting into their next pages
        # would only preempt someone at the next step
        headroom = sum(1 for r in self.running.values() if r.may_outgrow and not r.reserved_pages) \
            if self.prefill.waiting else 0
        chosen = self.prefill.schedule(in_flight, headroom)
        if chosen:
            desc, reqs, emits = self.builder.prefill(chosen)
            self.running.update((r.uid, r) for r, done in zip(reqs, emits) if done)
            return desc, reqs, emits
        decoding = self._make_room([r for r in self.running.values() if r.can_decode])
        return self.builder.decode(decoding) if decoding else None

    def _make_room(self, decoding: list[Req]) -> list[Req]:
        """Preempts requests that have outgrown their reservation, newest first, until the pages this
        decode step needs beyond reservations are available. Reservations are never taken: a request
        whose max_tokens fit its reservation runs to its end."""
        cache = self.cache
        if cache.available >= len(decoding):  # a decode step takes at most one page per request
            return decoding
        need = sum(cache.extra_pages(r, r.cached_len + 1) for r in decoding)
        if need <= cache.available:
            return decoding
        if self.in_flight is not None:
            # requests whose last token is in flight free their pages once it is handled, after this
            # launch: if that covers the shortage, the requests short of a page wait one step instead
            ending = sum(len(r.pages) + r.reserved_pages for r in self.running.values() if not r.can_decode)
            if need <= cache.available + ending:
                return [r for r in decoding if cache.extra_pages(r, r.cached_len + 1) == 0]
        for victim in sorted((r for r in decoding if r.may_outgrow), key=lambda r: r.arrival, reverse=True):
            need -= cache.extra_pages(victim, victim.cached_len + 1)
            self._preempt(victim)
            if need <= cache.available:
                break
        return [r for r in decoding if r.table_idx >= 0]

    def _preempt(self, req: Req) -> None:
        """Frees a running request's pages (its computed ones go to the prefix cache) and queues it
        first to be prefilled again over all its tokens; sampling is a function of (seed, position), so
        it goes on with the tokens it would have produced."""
        self.running.pop(req.uid)
        self._free(req)
        if self.in_flight is not None and req in self.in_flight.reqs:
            self.finished_reqs.add(req)  # its result in flight is dropped: the token is recomputed
        req.cached_len = req.prefix_hit_len = 0
        req.fill_len = req.device_len = len(req.input_ids)
        req.num_preempted += 1
        self.stats["preempted"] += 1
        self.prefill.waiting.appendleft(req)  # newest preempted first: each goes in front of the later ones
        log.debug("preempted request %d at %d tokens", req.uid, req.fill_len)

    # -- the two loops -------------------------------------------------------------------------------

    def _launch(self) -> Launched | None:
        built = self.schedule()
        if built is None:
            return None
        desc, reqs, emits = built
        self.stats["steps"] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d %s batch=%d tokens=%d running=%d waiting=%d free_pages=%d cached_pages=%d",
                      self.stats["steps"], "prefill" if desc.is_prefill else "decode", desc.batch_size,
                      desc.num_tokens, len(self.running), len(self.prefill.waiting), self.cache.allocator.num_free,
                      self.cache.cache.num_pages)
        try:
            output = self.executor.launch(desc)
        except ReplicaBrokenError as e:
            self.in_flight = None
            self.fail_all(str(e), ErrorKind.REPLICA_DOWN)
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure fails this batch, not the replica
            log.exception("step failed")
            self._fail(reqs, f"the engine failed this step: {type(e).__name__}: {e}", ErrorKind.ENGINE)
            return None
        return Launched(desc, reqs, emits, output)

    def normal_step(self, block: bool = False) -> None:
        self.slots.defer = False
        self._drain_inbox(block and not self.reqs)
        launched = self._launch()
        if launched is not None:
            self.in_flight = launched
            self._handle(launched)
            self.in_flight = None

    def overlap_step(self, block: bool = False) -> None:
        """Launch step N+1, then handle step N (self.in_flight) while N+1 computes."""
        self.slots.defer = True
        last = self.in_flight
        if last is None:
            self.slots.release_deferred()  # nothing in flight: nothing can still use them
        self._drain_inbox(block and last is None and not self.reqs)
        launched = self._launch()
        if last is not None:
            self._handle(last)
        self.in_flight = launched

    def step(self, block: bool = False) -> None:
        (self.overlap_step if self.config.overlap else self.normal_step)(block)

    def _handle(self, launched: Launched) -> None:
        out = launched.output
        try:
            self.executor.wait(out)  # this batch, and every one before it, is done on the device
        except ReplicaBrokenError as e:
            self.fail_all(str(e), ErrorKind.REPLICA_DOWN)
            raise
        self.slots.release_deferred()
        tokens = out.next_tokens.tolist()
        now = time.perf_counter()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        deltas: list[TokenDelta] = []
        newly_finished: set[Req] = set()
        for i, req in enumerate(launched.reqs):
            if req in self.finished_reqs or not launched.emits[i]:
                continue  # a stale result of a request that already ended, or a mid-prompt chunk
            token = tokens[i]
            req.input_ids.append(token)
            req.first_token = req.first_token or now
            req.last_token = now
            delta = TokenDelta(req.uid, token)
            if logprobs is not None and req.params.logprobs is not None:
                delta.logprob = logprobs[i]
                k = req.params.logprobs
                if k:
                    delta.top_logprobs = list(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
            # judged by tokens received: req.device_len is already a step ahead under overlap
            if (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
                delta.finished, delta.finish_reason = True, "stop"
            elif len(req.input_ids) >= req.max_device_len:
                delta.finished, delta.finish_reason = True, "length"
            deltas.append(delta)
            if delta.finished:
                self.running.pop(req.uid, None)
                self.reqs.pop(req.uid, None)
                self._free(req)
                newly_finished.add(req)
                if self.on_finish is not None:
                    self.on_finish(req, delta.finish_reason)
            elif launched.desc.is_prefill and self.cache.cache_prefix(req, req.fill_len):
                self.builder.rewrite_rows[req.table_idx] = req
        self.finished_reqs = newly_finished
        if deltas:
            self.on_output(deltas)

    def _fail(self, reqs: list[Req], why: str, kind: ErrorKind) -> None:
        for req in reqs:
            if req.uid in self.reqs:
                self._abort(req.uid, "error")
        self.on_output([TokenDelta.failure(r.uid, kind, why) for r in reqs])

    def fail_all(self, why: str, kind: ErrorKind = ErrorKind.ENGINE) -> None:
        """Ends every live request with an error of this kind."""
        self.in_flight = None
        self._drain_inbox(block=False)
        self._fail(list(self.reqs.values()), why, kind)

    # -- checks --------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Counts an operator (or a test) wants to see."""
        cache = self.cache
        return {"running": len(self.running), "waiting": len(self.prefill.waiting), "live": len(self.reqs),
                "slots_total": self.slots.num_slots, "slots_free": self.slots.available + self.slots.num_deferred,
                "pages_total": cache.num_pages, "pages_free": cache.allocator.num_free,
                "pages_cached": cache.cache.num_pages, "pages_reserved": cache.reserved,
                "prefix_hit_tokens": cache.prefill_tokens_saved, "prompt_tokens_admitted": cache.prompt_tokens_admitted,
                **self.stats}

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every KV page is free, prefix-cached or held by a live request."""
        self.cache.check_integrity([r for r in self.reqs.values() if r.table_idx >= 0])
