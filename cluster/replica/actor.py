"""The scheduler actor: one replica's tensor-parallel rank 0. Its loop runs on its own thread; the
methods beside it (submit, abort, poll, stats; called over its channel, cluster/channel.py, or
through Ray) only touch thread-safe queues. Results leave as one batch of deltas per poll, never one
call per token, with the prefix cache's KV events of the same steps beside them (a snapshot of every
block it holds first, to a new receiver: `kv_subscribe`).

Several routers may send to one replica: each is a subscriber (cluster/replica/subscribers.py),
whose requests' deltas and whose KV events wait for its own polls. A router that restarts releases
what its predecessor left (`release_subscriber`), so nothing keeps generating for a connection that
is gone."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cluster.channel import ChannelAddress, ChannelListener
from cluster.config import ReplicaConfig
from cluster.errors import ErrorKind
from cluster.messages import AddRequest, FirstTokenHops, ReplicaInfo, ReplicaOutput, ReplicaStats, TokenDelta
from cluster.model_info import load_tokenizer
from cluster.replica.engine_executors import LocalExecutor, TensorParallelExecutor
from cluster.replica.metrics import ReplicaMetrics
from cluster.replica.profiling import run_profiled
from cluster.replica.subscribers import Subscribers
from cluster.scheduler.build import build_scheduler
from cluster.scheduler.executor import ReplicaBrokenError
from cluster.scheduler.prefix_cache.events import KVEventStream
from cluster.scheduler.req import Req
from cluster.scheduler.scheduler import Scheduler
from worker.comm import free_address
from worker.follower import node_and_pid
from worker.rank import build_rank

log = logging.getLogger(__name__)

# how long a thread of the replica waits for the interpreter before the scheduler thread must hand it
# over: the channel's sender (a step's deltas) and reader (new requests) wait on the scheduler thread's
# Python, which holds it through a step's launch; at CPython's default of 5 ms a first token could sit
# that long on the host before it is sent
SWITCH_INTERVAL_S = 0.0005


class SchedulerActor:
    def __init__(self, config: ReplicaConfig, replica_id: int = 0) -> None:
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config, self.replica_id = config, replica_id
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # this process is the replica's alone
        self.scheduler: Scheduler | None = None
        self.subscribers = Subscribers()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        self.executor = None
        self.channel: ChannelListener | None = None
        # subscriber -> the first tokens' hops its last poll handed out, recorded at its next poll (poll)
        self._unrecorded: dict[int, list[FirstTokenHops]] = {}

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
        engine = build_rank(cfg.rank0_engine, 0, cfg.tp_size, self.address, cfg.collective_timeout_s)
        executor = (
            TensorParallelExecutor(engine, keepalive_s=cfg.collective_timeout_s / 4)
            if cfg.tp_size > 1
            else LocalExecutor(engine)
        )
        self.engine, self.executor = engine, executor
        self.metrics = ReplicaMetrics(self.replica_id, cfg.model_name or Path(cfg.engine.model_path).name)
        self.scheduler = build_scheduler(
            cfg,
            engine,
            executor,
            load_tokenizer(cfg.engine.model_path),
            on_output=self._publish,
            on_finish=self._on_finish,
        )
        self.subscribers.kv = KVEventStream(engine.page_size)
        self._thread = threading.Thread(target=self._loop, name=f"scheduler-{self.replica_id}", daemon=True)
        self._thread.start()
        if isinstance(executor, TensorParallelExecutor):
            threading.Thread(target=self._watch, args=(executor,), name="tp-watchdog", daemon=True).start()
        threading.Thread(target=self._reap_loop, name="subscriber-reaper", daemon=True).start()
        self.channel = ChannelListener(self, _node_ip())
        return ReplicaInfo(
            max_seq_len=engine.max_seq_len,
            num_pages=engine.num_pages,
            page_size=engine.page_size,
            vocab_size=engine.hf_config.vocab_size,
            eos_ids=tuple(sorted(self.scheduler.eos_ids)),
            startup=tuple(engine.startup.as_dict().items()),
        )

    def _loop(self) -> None:
        run_profiled(self._steps, self.replica_id)

    def _steps(self) -> None:
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

    @property
    def broken(self) -> str | None:
        """Why the replica cannot serve any more; None while it serves."""
        return self.subscribers.failed

    def _publish(self, deltas: list[TokenDelta]) -> None:
        # once broken, the watchdog has failed every request: nothing more may reach them
        self.metrics.on_output(self.subscribers.publish(deltas, *self.scheduler.cache.take_kv_events()))

    def _take_kv_events(self) -> None:
        self.subscribers.add_kv_events(*self.scheduler.cache.take_kv_events())

    def _on_finish(self, req: Req, reason: str) -> None:
        if self.broken and not self.subscribers.is_live(req.uid):
            return  # counted when the replica failed
        self.metrics.on_finish(req, reason)

    def _watch(self, executor: TensorParallelExecutor) -> None:
        """Fails the replica when one step's launch or wait outlasts the collective timeout: on GPUs a
        dead or stalled rank leaves the scheduler thread blocked on the device, unable to fail its own
        requests."""
        limit = self.config.collective_timeout_s
        while not self._stop.wait(limit / 8) and not self.broken:
            if executor.stuck_for() > limit:
                self._fail_replica(
                    f"tensor-parallel group failed: a step has not finished in {limit:g} s (a rank is gone or stalled)"
                )

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.subscribers.timeout_s / 4):
            self.reap_silent_subscribers(time.monotonic())

    def reap_silent_subscribers(self, now: float) -> list[int]:
        """Releases the routers that have not polled for the subscriber timeout and aborts their
        requests (Subscribers.release_silent). Returns those released."""
        released = self.subscribers.release_silent(now)
        for sub, uids in released.items():
            self._record_first_tokens(sub)
            if uids:
                log.warning(
                    "replica %d: router %d stopped polling; aborting its %d request(s)",
                    self.replica_id,
                    sub - 1,
                    len(uids),
                )
                self.abort(uids)
        return list(released)

    def _fail_replica(self, why: str) -> None:
        """Marks the replica broken and ends every request it holds with the error; later requests get
        the error at once. The router replaces a broken replica."""
        failed = self.subscribers.fail(why)
        if failed is not None:
            log.error("replica %d is broken: %s", self.replica_id, why)
            self.metrics.on_replica_failed(failed)

    # -- called over the channel, or through Ray ---------------------------------------------------

    def submit(self, requests: list[AddRequest], subscriber: int = 0) -> None:
        now = time.perf_counter()  # a request's queue time starts as it reaches the replica
        for request in requests:
            request.received = now
        if not self.subscribers.submitted([r.uid for r in requests], subscriber):
            self.metrics.on_replica_failed(len(requests))
            return
        for request in requests:
            self.scheduler.submit(request)

    def abort(self, uids: list[int]) -> None:
        self.subscribers.aborted(uids)  # an aborted request gets no delta
        for uid in uids:
            self.scheduler.abort(uid)

    def release_subscriber(self, subscriber: int) -> int:
        """Aborts every request that subscriber sent and drops what waits for it: a router that restarts
        calls this for its predecessor, whose clients' connections closed with it. Returns how many
        requests were aborted."""
        uids = self.subscribers.release(subscriber)
        self.abort(uids)
        self._record_first_tokens(subscriber)  # its last poll's: it polls no more
        return len(uids)

    def poll(
        self,
        timeout_s: float = 1.0,
        subscriber: int = 0,
        kv_events: bool = True,
        receives: Callable[[], bool] | None = None,
    ) -> ReplicaOutput:
        """Every delta for subscriber since its last poll, and its KV events (Subscribers.poll). The first
        tokens' hops go into the metrics at the subscriber's next poll, once this answer is sent: a
        histogram's record lets go of the interpreter, and the scheduler thread, woken by the take, would
        keep it for a switch interval (0.3 ms of the time to first token on a 2-core host)."""
        self._record_first_tokens(subscriber)
        out = self.subscribers.poll(timeout_s, subscriber, kv_events, receives)
        if firsts := [d.hops for d in out if d.hops is not None]:
            self._unrecorded[subscriber] = firsts
        return out

    def _record_first_tokens(self, subscriber: int) -> None:
        for hops in self._unrecorded.pop(subscriber, ()):
            self.metrics.on_first_token(hops)

    def kv_subscribe(self, subscriber: int = 0) -> None:
        """The next poll of subscriber carries every block hash the prefix cache holds (a router that
        connects late, or the router of a replacement), and the later ones what changed since."""
        self.subscribers.resync_kv(subscriber)

    def stats(self) -> ReplicaStats:
        return self.scheduler.call_between_steps(self._stats).result(timeout=30)

    def _stats(self) -> ReplicaStats:
        self.metrics.flush(self.scheduler.snapshot)  # so a scrape after this call sees every token so far
        import psutil

        return ReplicaStats(
            **vars(self.scheduler.snapshot()),
            replica=self.replica_id,
            broken=self.broken,
            rss_bytes=psutil.Process().memory_info().rss,
        )

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
        self.subscribers.close()
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
