"""A deployment's replicas on Ray: started together, replaced one at a time, grown and shrunk by one at
the end (ids stay 0..n-1), shut down together. Whoever watches their health or load decides when;
the fleet does it on its own threads, so stopping never waits on an event loop's executor, and
`shutdown()` takes down a replica still being built (it leaves no placement group behind)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from cluster.config import ReplicaConfig
from cluster.fleet.deploy import ReplicaHandle

log = logging.getLogger(__name__)

# (config, replica id, abandon) -> a started replica; ReplicaHandle, or a stand-in in tests
BuildReplica = Callable[..., ReplicaHandle]


class Fleet:
    def __init__(
        self, config: ReplicaConfig, replicas: list[ReplicaHandle], build: BuildReplica = ReplicaHandle
    ) -> None:
        """Takes over replicas already started; `start` places new ones."""
        self.config, self._build = config, build
        self._replicas = list(replicas)
        self._building: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # threads start only when used: room for every replica's replacement and a growing fleet
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="replica-rebuild")
        self._adding: Future | None = None
        # the replica being added is given up: no longer wanted, or the fleet shuts down
        self._add_abandoned = threading.Event()
        self._added: ReplicaHandle | None = None  # the one being added, once built

    @classmethod
    def start(cls, config: ReplicaConfig, size: int, build: BuildReplica = ReplicaHandle) -> Fleet:
        """Places and starts `size` replicas at once; if any fails, shuts the others down and raises
        its error. An interrupt (Ctrl-C) abandons the replicas still starting (each shuts itself down
        within a second) and raises at once, not after the placement's 600 s wait."""
        abandon = threading.Event()
        pool = ThreadPoolExecutor(max_workers=size)
        futures: list[Future] = []
        started, errors = [], []
        try:
            for i in range(size):
                futures.append(pool.submit(build, config, i, abandon=abandon))
            for f in futures:
                try:
                    started.append(f.result())
                except Exception as e:  # noqa: BLE001 - shut the others down, then report
                    errors.append(e)
        except BaseException:  # KeyboardInterrupt, SystemExit: the builds give up; what one built goes down
            abandon.set()
            for f in futures:  # now where it is built already, else once its build ends
                f.add_done_callback(_shutdown_built)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if errors:
            for replica in started:
                _shutdown_quietly(replica)
            raise errors[0]
        return cls(config, started, build)

    @property
    def replicas(self) -> list[ReplicaHandle]:
        """The serving replica of each id (a replica whose replacement failed stays until one succeeds)."""
        with self._lock:
            return list(self._replicas)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def replace(self, i: int) -> Future | None:
        """Shuts replica i down and starts a fresh one in its place, on a fleet thread. The future
        gives the new replica once it serves, or None when the fleet was shut down meanwhile; it
        raises when the new one could not start. None (no future) once the fleet is shut down."""
        with self._lock:
            if self._closed.is_set():
                return None
            future = self._pool.submit(self._rebuild, i, self._replicas[i])
            self._building[i] = future
        return future

    def _rebuild(self, i: int, old: ReplicaHandle) -> ReplicaHandle | None:
        try:
            # a replica is replaced once it failed: one hung would never answer a request to stop
            old.shutdown(graceful_s=0)
            new = self._build(self.config, i, abandon=self._closed)
            with self._lock:
                if not self._closed.is_set() and i < len(self._replicas):
                    self._replicas[i] = new
                    return new
            # shutdown() came first; it may have stopped waiting for this one
            _shutdown_quietly(new)
            return None
        finally:
            with self._lock:
                self._building.pop(i, None)

    def add(self) -> Future | None:
        """Starts one more replica, with the next id, on a fleet thread: its placement group asks Ray
        for its GPUs (on a `ray up` cluster with none free, the autoscaler adds a node). The future
        gives the replica once it serves and is in the fleet, None when the fleet was shut down
        meanwhile; it raises when the replica could not start. None (no future) when the fleet is
        shut down or another replica is being added."""
        with self._lock:
            if self._closed.is_set() or self._adding is not None:
                return None
            i = len(self._replicas)
            self._add_abandoned = threading.Event()
            self._adding = self._building[i] = self._pool.submit(self._add, i, self._add_abandoned)
            return self._adding

    def abandon_add(self) -> bool:
        """Gives up the replica being added (no longer wanted: the load fell while it waited for resources or
        started); its build stops within a second and its future raises. Whether one was being added."""
        with self._lock:
            if self._adding is None or self._added is not None:  # none, or built already: it serves
                return False
            self._add_abandoned.set()
            return True

    def _add(self, i: int, abandoned: threading.Event) -> ReplicaHandle | None:
        try:
            new = self._build(self.config, i, abandon=abandoned)
            with self._lock:
                if not self._closed.is_set():
                    self._replicas.append(new)
                    self._added = new
                    return new
            _shutdown_quietly(new)
            return None
        finally:
            with self._lock:
                self._building.pop(i, None)
                self._adding = self._added = None

    def remove_last(self) -> Future | None:
        """Takes the last replica out of the fleet and shuts it down on a fleet thread (the caller has
        drained it: nothing routes to it and it holds no request). None when the fleet is shut down,
        holds one replica only, or that replica is being replaced."""
        with self._lock:
            i = len(self._replicas) - 1
            if self._closed.is_set() or i < 1 or i in self._building:
                return None
            replica = self._replicas.pop()
            return self._pool.submit(_shutdown_quietly, replica)

    def shutdown(self, timeout_s: float = 600.0) -> None:
        """Stops every replica. A replacement still being built is abandoned or, once up, shut down
        by its own thread; this waits up to timeout_s for it. Idempotent."""
        with self._lock:
            self._closed.set()
            self._add_abandoned.set()
            building = list(self._building.values())
        for future in building:
            try:
                future.result(timeout=timeout_s)
            except TimeoutError:
                log.error("a replacement replica is still starting after %g s; it stops once started", timeout_s)
            except Exception:  # noqa: BLE001 - it failed or was abandoned: it cleaned up after itself
                pass
        self._pool.shutdown(wait=False)
        with self._lock:
            replicas, self._replicas = self._replicas, []
        # at once: a hung replica's wait for its scheduler then costs the shutdown its length once, not once each
        with ThreadPoolExecutor(max_workers=max(1, len(replicas)), thread_name_prefix="replica-shutdown") as pool:
            list(pool.map(_shutdown_quietly, replicas))


def _shutdown_built(future: Future) -> None:
    """Shuts down the replica a build made, if it made one."""
    if not future.cancelled() and future.exception() is None:
        _shutdown_quietly(future.result())


def _shutdown_quietly(replica: ReplicaHandle) -> None:
    """Shuts a replica down, logging a failure instead of raising (the others must still be shut down)."""
    try:
        replica.shutdown()
    except Exception as e:  # noqa: BLE001
        log.error("replica %d did not shut down cleanly: %s", replica.replica_id, e)
