"""The scheduler actor: one replica's tensor-parallel rank 0. Its loop runs on its own thread; the
Ray methods beside it (submit, abort, poll, stats) only touch thread-safe queues. Results leave as
one batch of deltas per poll, never one call per token, with the prefix cache's KV events of the same
steps beside them (a snapshot of every block it holds first, to a new receiver: `kv_subscribe`).

Several routers may send to one replica: each is a subscriber (its index), whose requests' deltas
and whose KV events wait for its own polls. A router that restarts releases what its predecessor
left (`release_subscriber`), so nothing keeps generating for a connection that is gone."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from cluster.channel import ChannelAddress, ChannelListener
from cluster.config import ReplicaConfig
from cluster.grammars import Grammars
from cluster.errors import ErrorKind
from cluster.engine_executors import LocalExecutor, TensorParallelExecutor
from cluster.executor import ReplicaBrokenError
from cluster.messages import AddRequest, ReplicaInfo, ReplicaOutput, ReplicaStats, TokenDelta
from cluster.metrics import ReplicaMetrics
from cluster.model_info import eos_token_ids, load_tokenizer
from cluster.prefix_cache.events import KVEventStream
from cluster.req import Req
from cluster.scheduler import Scheduler
from worker.comm import free_address
from worker.follower import node_and_pid
from worker.rank import build_rank

log = logging.getLogger(__name__)

SUBSCRIBER_TIMEOUT_S = 60.0  # a router silent this long is gone: its requests are aborted


class SchedulerActor:
    def __init__(self, config: ReplicaConfig, replica_id: int = 0) -> None:
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config, self.replica_id = config, replica_id
        self.scheduler: Scheduler | None = None
        self.broken: str | None = None
        self._outboxes: dict[int, list[TokenDelta]] = {}  # by subscriber
        self._owner: dict[int, int] = {}  # uid -> the subscriber that submitted it
        self._last_poll: dict[int, float] = {}  # subscriber -> when it last polled (monotonic)
        self._live: set[int] = set()  # submitted and not yet finished
        self._kv: KVEventStream | None = None
        # one lock for the outboxes and the live set; each subscriber's poll waits on its own condition
        # of it, so a step wakes only the routers it has deltas for (an idle poller woken at every step
        # would take the interpreter from the scheduler thread for nothing)
        self._lock = threading.Lock()
        self._wakeups: dict[int, threading.Condition] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        self.executor = None
        self.channel: ChannelListener | None = None

    def node_and_pid(self) -> tuple[str, int]:
        return node_and_pid()

    def rendezvous_address(self) -> str:
        import ray
        self.address = free_address(ray.util.get_node_ip_address())
        return self.address

    def start(self) -> ReplicaInfo:
        """Joins the group (tp > 1), loads rank 0's engine and starts the loop. Returns what the
        router needs to know of the model."""
        cfg = self.config
        engine = build_rank(cfg.engine, 0, cfg.tp_size, self.address, cfg.collective_timeout_s)
        executor = (TensorParallelExecutor(engine, keepalive_s=cfg.collective_timeout_s / 4) if cfg.tp_size > 1
                    else LocalExecutor(engine))
        self.engine, self.executor = engine, executor
        tokenizer = load_tokenizer(cfg.engine.model_path)
        eos = eos_token_ids(cfg.engine.model_path, engine.hf_config, tokenizer)
        vocab = engine.hf_config.vocab_size
        self.metrics = ReplicaMetrics(self.replica_id, cfg.model_name or Path(cfg.engine.model_path).name)
        self.scheduler = Scheduler(cfg.scheduler, executor, num_pages=engine.num_pages, page_size=engine.page_size,
                                   max_running_reqs=cfg.engine.max_running_reqs, max_seq_len=engine.max_seq_len,
                                   eos_ids=eos, on_output=self._publish, on_finish=self._on_finish,
                                   vocab_size=vocab, max_logit_bias=cfg.engine.max_logit_bias,
                                   grammars=Grammars(tokenizer, vocab, sorted(eos)) if tokenizer is not None else None)
        self._kv = KVEventStream(engine.page_size)
        self._thread = threading.Thread(target=self._loop, name=f"scheduler-{self.replica_id}", daemon=True)
        self._thread.start()
        if isinstance(executor, TensorParallelExecutor):
            threading.Thread(target=self._watch, args=(executor,), name="tp-watchdog", daemon=True).start()
        threading.Thread(target=self._reap_loop, name="subscriber-reaper", daemon=True).start()
        self.channel = ChannelListener(self, _node_ip())
        return ReplicaInfo(max_seq_len=engine.max_seq_len, num_pages=engine.num_pages, page_size=engine.page_size,
                           vocab_size=engine.hf_config.vocab_size, eos_ids=tuple(sorted(eos)))

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set() and not self.broken:
            try:
                sched.step(block=True)
                self._take_kv_events()  # a step without deltas: its events go with the next ones
                if not self.broken:  # a broken replica's gauges stay at zero
                    self.metrics.on_step(sched.snapshot)
                self.executor.keepalive()
            except ReplicaBrokenError as e:
                self._fail_replica(str(e))
                break
            except Exception as e:  # noqa: BLE001 - never let the loop die silently
                log.exception("scheduler step failed")
                try:
                    sched.fail_all(f"scheduler error: {type(e).__name__}: {e}", ErrorKind.ENGINE)
                except Exception as again:  # noqa: BLE001 - its state is not to be trusted: the replica is replaced
                    log.exception("failing the requests after a scheduler error failed too")
                    self._fail_replica(f"scheduler error: {type(e).__name__}: {e}; then {type(again).__name__}")
                    break
        while self.broken and not self._stop.is_set():  # answer what still arrives with the error
            try:
                sched.receive(block=True)
                sched.fail_all(self.broken, ErrorKind.REPLICA_DOWN)
            except Exception:  # noqa: BLE001 - a broken scheduler's state may be anything; submit() answers
                log.exception("a broken replica could not answer a request")
                self._stop.wait(0.1)

    def _publish(self, deltas: list[TokenDelta]) -> None:
        with self._lock:
            if self.broken:  # the watchdog has failed every request: nothing more may reach them
                deltas = [d for d in deltas if d.uid in self._live]
            self.metrics.on_output(deltas)
            self._live.difference_update(d.uid for d in deltas if d.finished)
            owners = self._deliver(deltas)
            # the step's cache changes (a finished request's pages among them) in the same message
            self._kv.add(*self.scheduler.cache.take_kv_events())
            self._notify(owners)

    def _take_kv_events(self) -> None:
        stored, removed = self.scheduler.cache.take_kv_events()
        if stored or removed:
            with self._lock:
                self._kv.add(stored, removed)

    def _on_finish(self, req: Req, reason: str) -> None:
        if self.broken and req.uid not in self._live:
            return  # counted when the replica failed
        self.metrics.on_finish(req, reason)

    def _watch(self, executor: TensorParallelExecutor) -> None:
        """Fails the replica when one step's launch or wait outlasts the collective timeout: on GPUs a
        dead or stalled rank leaves the scheduler thread blocked on the device, unable to fail its own
        requests."""
        limit = self.config.collective_timeout_s
        while not self._stop.wait(limit / 8) and not self.broken:
            if executor.stuck_for() > limit:
                self._fail_replica(f"tensor-parallel group failed: a step has not finished in {limit:g} s "
                                   "(a rank is gone or stalled)")

    def _reap_loop(self) -> None:
        while not self._stop.wait(SUBSCRIBER_TIMEOUT_S / 4):
            self.reap_silent_subscribers(time.monotonic())

    def reap_silent_subscribers(self, now: float) -> list[int]:
        """Releases the routers (subscribers 1 and up) that have not polled for SUBSCRIBER_TIMEOUT_S:
        a router polls at least every second, so one that stopped is gone for good (Ray would have
        restarted it by then), and its requests must not run on for no one. Returns those released."""
        with self._lock:  # decided and released at once: a poll in between would keep the router
            silent = [sub for sub, seen in self._last_poll.items() if sub and now - seen > SUBSCRIBER_TIMEOUT_S]
            released = {sub: self._release_locked(sub) for sub in silent}
        for sub, uids in released.items():
            if uids:
                log.warning("replica %d: router %d stopped polling; aborting its %d request(s)", self.replica_id,
                            sub - 1, len(uids))
                self.abort(uids)
        return silent

    def _fail_replica(self, why: str) -> None:
        """Marks the replica broken and ends every request it holds with the error; later requests get
        the error at once. The router replaces a broken replica."""
        with self._lock:
            if self.broken:
                return
            log.error("replica %d is broken: %s", self.replica_id, why)
            self.broken = why
            self._deliver(_error_deltas(sorted(self._live), why))
            self.metrics.on_replica_failed(len(self._live))
            self._live.clear()
            self._notify(self._wakeups)

    # -- called through Ray ------------------------------------------------------------------------

    def _deliver(self, deltas: list[TokenDelta]) -> set[int]:
        """Into each delta's subscriber's outbox (the lock held); a finished request forgets its owner.
        Returns the subscribers delivered to."""
        owners = set()
        for d in deltas:
            owner = self._owner.pop(d.uid, 0) if d.finished else self._owner.get(d.uid, 0)
            self._outboxes.setdefault(owner, []).append(d)
            owners.add(owner)
        return owners

    def _wakeup(self, subscriber: int) -> threading.Condition:
        """The condition subscriber's poll waits on (the lock held)."""
        if (cond := self._wakeups.get(subscriber)) is None:
            cond = self._wakeups[subscriber] = threading.Condition(self._lock)
        return cond

    def _notify(self, subscribers) -> None:
        """Wakes the polls of these subscribers (the lock held)."""
        for sub in subscribers:
            if (cond := self._wakeups.get(sub)) is not None:
                cond.notify_all()

    def submit(self, requests: list[AddRequest], subscriber: int = 0) -> None:
        with self._lock:
            if self.broken:
                self._outboxes.setdefault(subscriber, []).extend(_error_deltas([r.uid for r in requests], self.broken))
                self.metrics.on_replica_failed(len(requests))
                self._notify((subscriber,))
                return
            self._live.update(r.uid for r in requests)
            if subscriber:
                self._owner.update((r.uid, subscriber) for r in requests)
        for request in requests:
            self.scheduler.submit(request)

    def abort(self, uids: list[int]) -> None:
        with self._lock:  # an aborted request gets no delta: it leaves the live set here
            self._live.difference_update(uids)
            for uid in uids:
                self._owner.pop(uid, None)
        for uid in uids:
            self.scheduler.abort(uid)

    def release_subscriber(self, subscriber: int) -> int:
        """Aborts every request that subscriber sent and drops what waits for it: a router that restarts
        calls this for its predecessor, whose clients' connections closed with it. Returns how many
        requests were aborted."""
        with self._lock:
            uids = self._release_locked(subscriber)
        self.abort(uids)
        return len(uids)

    def _release_locked(self, subscriber: int) -> list[int]:
        uids = sorted(uid for uid, owner in self._owner.items() if owner == subscriber and uid in self._live)
        self._outboxes.pop(subscriber, None)
        self._last_poll.pop(subscriber, None)
        if self._kv is not None:
            self._kv.drop(subscriber)
        return uids

    def poll(self, timeout_s: float = 1.0, subscriber: int = 0, kv_events: bool = True,
             receives: Callable[[], bool] | None = None) -> ReplicaOutput:
        """Every delta for subscriber since its last poll, and (`kv_events`) the KV events since then;
        waits up to timeout_s for the first delta (or a snapshot due). Changes to the cache alone wake no
        poll: they go with the next deltas, so a step is one message. A subscriber that polls without
        kv_events is no receiver of them: nothing is kept for it. `receives`: asked (the lock held)
        before anything is taken; when it says no, the poll takes nothing (a channel's connection that
        a newer one of its router has replaced must leave the deltas to that one)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            wakeup = self._wakeup(subscriber)
            while (not self._outboxes.get(subscriber) and not (kv_events and self._kv_snapshot_due(subscriber))
                   and not self._stop.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wakeup.wait(left)
            if receives is not None and not receives():
                return ReplicaOutput([], None, len(self._live))
            self._last_poll[subscriber] = time.monotonic()
            out = self._outboxes.pop(subscriber, [])
            kv = self._kv.take(subscriber) if self._kv is not None and kv_events else None
            return ReplicaOutput(out, kv, len(self._live))

    def _kv_snapshot_due(self, subscriber: int = 0) -> bool:
        return self._kv is not None and self._kv.snapshot_due(subscriber)

    def kv_subscribe(self, subscriber: int = 0) -> None:
        """The next poll of subscriber carries every block hash the prefix cache holds (a router that
        connects late, or the router of a replacement), and the later ones what changed since."""
        with self._lock:
            if self._kv is not None:
                self._kv.resync(subscriber)
            self._notify((subscriber,))

    def stats(self) -> ReplicaStats:
        return self.scheduler.call_between_steps(self._stats).result(timeout=30)

    def _stats(self) -> ReplicaStats:
        self.metrics.flush(self.scheduler.snapshot)  # so a scrape after this call sees every token so far
        import psutil
        return ReplicaStats(**vars(self.scheduler.snapshot()), replica=self.replica_id, broken=self.broken,
                            rss_bytes=psutil.Process().memory_info().rss)

    def check_integrity(self) -> None:
        self.scheduler.call_between_steps(self.scheduler.check_integrity).result(timeout=30)

    def channel_address(self) -> ChannelAddress | None:
        """Where routers connect for submits and deltas without Ray calls (cluster/channel.py)."""
        return None if self.channel is None else self.channel.address

    def health(self) -> str | None:
        """None while the replica serves; once it is broken, why (what its requests were told)."""
        return self.broken

    def shutdown(self) -> None:
        self._stop.set()
        if self.channel is not None:
            self.channel.close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.broken is None and self.executor is not None:  # None: start() failed before it had one
            self.executor.shutdown()
        # a broken group cannot be taken down in order (a peer is gone, a kernel may spin on the
        # GPU): the caller kills this process, which frees everything


def _node_ip() -> str:
    """This node's address as Ray knows it (what routers on other nodes reach); loopback outside Ray."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _error_deltas(uids: list[int], why: str) -> list[TokenDelta]:
    return [TokenDelta.failure(uid, ErrorKind.REPLICA_DOWN, why) for uid in uids]
