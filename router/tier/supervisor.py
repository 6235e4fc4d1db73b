"""Keeps the replicas serving, and /health true: a replica whose scheduler actor died, whose
tensor-parallel group broke (a follower died, a collective timed out), or that stays silent past the
health-check timeout is
taken out of routing, and the fleet is asked to replace it; traffic returns to it when its
replacement is ready. This decides when; the fleet (cluster/fleet/fleet.py) does the replacing. It also
watches Ray's control store: with it gone for longer than the health-check timeout, /health fails."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from cluster import Fleet, ReplicaHandle, control_store_answers
from router.http.state import RouterState
from router.replicas.client import ReplicaClient, client_for

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0  # a cluster short of GPUs stays so a while; never wait longer than this to retry


class Supervisor:
    def __init__(
        self,
        state: RouterState,
        fleet: Fleet,
        interval_s: float = 1.0,
        on_replaced: Callable[[int, ReplicaHandle], None] | None = None,
        on_failed: Callable[[int, object, str], None] | None = None,
    ) -> None:
        """`on_replaced(i, replica)`: told when replica i's replacement serves; `on_failed(replica_id,
        actor, why)`: when a health check finds a replica (that scheduler actor) failed (both: the router
        actors)."""
        self.state, self.fleet, self.interval_s, self.on_replaced = state, fleet, interval_s, on_replaced
        self.on_failed = on_failed
        self.restarts = 0
        self._checking: set[ReplicaClient] = set()  # one check in flight per client: a slow one delays no other
        self._replacing: set[int] = set()  # until the replacement's client is routed to, or it failed
        self._retry_at: dict[int, tuple[float, float]] = {}  # replica -> (when, backoff) after a failed start
        self._control_store_seen = time.monotonic()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        watch = threading.Thread(target=self._watch_control_store, name="control-store-watch", daemon=True)
        watch.start()
        while not self.fleet.closed:
            await asyncio.sleep(self.interval_s)
            silent = time.monotonic() - self._control_store_seen
            limit = self.state.config.health_check_timeout_s
            self.state.control_store_error = (
                f"Ray's control store (GCS) has not answered for {silent:.0f} s: the cluster can place and "
                f"replace nothing"
                if silent > limit
                else None
            )
            for i, client in enumerate(self.state.clients):
                if client.healthy and client not in self._checking:
                    self._checking.add(client)
                    loop.create_task(self._check(client))
                elif (
                    not client.healthy
                    and i not in self._replacing
                    and i not in self.state.retiring  # leaving the fleet: the autoscaler removes it
                    and not self.state.draining
                    and loop.time() >= self._retry_at.get(i, (0.0, 0.0))[0]
                ):
                    self._replace(i, client)

    @property
    def replacing(self) -> set[int]:
        """The replicas whose replacement is being built."""
        return self._replacing

    def _watch_control_store(self) -> None:
        """On its own thread (a probe blocks for up to its timeout): when Ray's control store last answered."""
        timeout = min(2.0, self.state.config.health_check_timeout_s / 2)
        while not self.fleet.closed:
            if control_store_answers(timeout):
                self._control_store_seen = time.monotonic()
            time.sleep(self.interval_s)

    async def _check(self, client: ReplicaClient) -> None:
        try:
            why = await client.check_health()
            if why is not None and client.healthy:
                client.mark_failed(why)
                if self.on_failed is not None:
                    self.on_failed(client.replica_id, client.actor, why)
        finally:
            self._checking.discard(client)

    def _replace(self, i: int, client: ReplicaClient) -> None:
        future = self.fleet.replace(i)
        if future is None:
            return  # the fleet is shutting down
        log.warning("replacing replica %d: %s", i, client.error)
        self._replacing.add(i)
        loop = asyncio.get_running_loop()
        loop.create_task(self._install(i, future))
        loop.create_task(client.stop())

    async def _install(self, i: int, future: Future) -> None:
        try:
            new = await asyncio.wrap_future(future)
        except Exception as e:  # noqa: BLE001 - try again later, waiting twice as long each time
            backoff = min(2 * self._retry_at.get(i, (0.0, self.interval_s / 2))[1], _MAX_BACKOFF_S)
            self._retry_at[i] = (asyncio.get_running_loop().time() + backoff, backoff)
            log.error("replica %d could not be replaced (next try in %g s): %s", i, backoff, e)
            new = None
        finally:
            self._replacing.discard(i)
        if new is None or self.fleet.closed:
            return  # when closed, the fleet shuts the new replica down with the others
        # beside router actors (they are told of replacements) this process routes nothing: no cache contents
        client = client_for(new, self.state.config, kv_events=self.on_replaced is None)
        client.start()
        self.state.set_client(i, client)
        if self.on_replaced is not None:
            self.on_replaced(i, new)
        self.restarts += 1
        self._retry_at.pop(i, None)
        log.warning("replica %d is serving again", i)
