"""Keeps the replicas serving: a replica whose scheduler actor died, whose tensor-parallel group broke
(a follower died, a collective timed out), or that stays silent past the health-check timeout is
taken out of routing and replaced with a fresh one placed by Ray; traffic returns to it when it is
ready. Replacements are built on the supervisor's own threads, so stopping the server never waits
on the event loop's executor, and `close()` takes down any replacement still being built."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from cluster.deploy import ReplicaHandle, shutdown_quietly
from router.replica_client import ReplicaClient

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, server, interval_s: float = 1.0) -> None:
        self.server, self.interval_s = server, interval_s
        self.restarts = 0
        self._checking: set[ReplicaClient] = set()  # one check in flight per client: a slow one delays no other
        self._building: dict[int, Future] = {}
        self._retry_at: dict[int, tuple[float, float]] = {}  # replica -> (when, backoff) after a failed start
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(len(server.replicas), 1), thread_name_prefix="replica-rebuild")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed.is_set():
            await asyncio.sleep(self.interval_s)
            for i, client in enumerate(self.server.state.clients):
                if client.healthy and client not in self._checking:
                    self._checking.add(client)
                    loop.create_task(self._check(client))
                elif (not client.healthy and i not in self._building and not self.server.state.draining
                      and loop.time() >= self._retry_at.get(i, (0.0, 0.0))[0]):
                    self._replace(i)

    async def _check(self, client: ReplicaClient) -> None:
        try:
            why = await client.check_health()
            if why is not None and client.healthy:
                client.mark_failed(why)
        finally:
            self._checking.discard(client)

    def _replace(self, i: int) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            log.warning("replacing replica %d: %s", i, self.server.state.clients[i].error)
            future = self._pool.submit(self._rebuild, i, self.server.replicas[i])
            self._building[i] = future
        asyncio.ensure_future(self._install(i, future))
        asyncio.get_running_loop().create_task(self.server.state.clients[i].stop())

    def _rebuild(self, i: int, old: ReplicaHandle) -> ReplicaHandle | None:
        """On a supervisor thread: the old replica down, a new one up (None when closed meanwhile)."""
        old.shutdown()
        new = ReplicaHandle(old.config, i, abandon=self._closed)
        with self._lock:
            closed = self._closed.is_set()
        if closed:  # close() may have given up waiting for this one
            shutdown_quietly(new)
            return None
        return new

    async def _install(self, i: int, future: Future) -> None:
        try:
            new = await asyncio.wrap_future(future)
        except Exception as e:  # noqa: BLE001 - try again, backing off (a cluster short of GPUs stays so a while)
            backoff = min(2 * self._retry_at.get(i, (0.0, self.interval_s / 2))[1], 60.0)
            self._retry_at[i] = (asyncio.get_running_loop().time() + backoff, backoff)
            log.error("replica %d could not be replaced (next try in %g s): %s", i, backoff, e)
            new = None
        with self._lock:
            self._building.pop(i, None)
            if new is None or self._closed.is_set():
                return  # when closed, close() has this future and shuts its replica down
            client = ReplicaClient(i, new.actor, new.info, self.server.config.health_check_timeout_s)
            client.start()
            self.server.replicas[i] = new
            self.server.state.clients[i] = client
            self.restarts += 1
            self._retry_at.pop(i, None)
        log.warning("replica %d is serving again", i)

    def close(self, timeout_s: float = 600.0) -> None:
        """Stops replacing; a replacement still being built is abandoned or, once up, shut down. Call
        before shutting the installed replicas down."""
        with self._lock:
            self._closed.set()
            building = list(self._building.values())
        for future in building:
            try:
                new = future.result(timeout=timeout_s)
            except TimeoutError:
                log.error("a replacement replica is still starting after %g s; it stops once started", timeout_s)
                continue
            except Exception:  # noqa: BLE001 - it failed or was abandoned: it cleaned up after itself
                continue
            if new is not None:
                shutdown_quietly(new)  # never installed: _install saw the supervisor closed
        self._pool.shutdown(wait=False)

