"""Applies the autoscaling policy (cluster/fleet/autoscale.py) to the fleet, from the launching
process: each round it reads every serving replica's own figures (waiting and running requests), asks
the policy how many replicas it wants, and moves the fleet one replica towards that. A replica is
added at the end (its placement group asks Ray for its GPUs) and routed to once it serves; the last
one is removed by draining it first: no router sends it anything new, the requests it has finish,
then it is shut down, so nothing is cut. One change at a time; none while the supervisor heals a
replica. Every decision is one log line, and the figures are gauges (Ray's, and the routers' /metrics)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from cluster import AutoscalePolicy, AutoscaleSettings, Fleet, FleetMetrics, ReplicaLoad
from router.http.state import RouterState
from router.replicas.client import client_for

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0  # a cluster short of GPUs stays so a while; never wait longer than this to retry
_RETELL_S = 10.0
_STARTING_TOLD_S = 60.0  # how often a start that takes long is said to go on


class Autoscaler:
    def __init__(
        self,
        state: RouterState,
        fleet: Fleet,
        supervisor,
        tier=None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`supervisor`: whose replacements pause autoscaling; `tier`: the router actors
        (router/tier/tier.py), told of every replica that joins or retires; None when this process routes."""
        self.state, self.fleet, self.supervisor, self.tier = state, fleet, supervisor, tier
        self.interval_s, self.clock = interval_s, clock
        self.policy = AutoscalePolicy(AutoscaleSettings.of(state.config))
        self.metrics = FleetMetrics(state.config.model_name)
        self.wanted = len(state.clients)
        self.added = self.removed = self.failed_starts = 0
        self._adding: Future | None = None
        self._adding_since = self._adding_told = 0.0
        self._abandoning = False  # the replica being added was given up
        self._retry_at, self._backoff = 0.0, interval_s / 2
        self._size: tuple[int, int] | None = None  # (wanted, running) last exported
        self._told_at = 0.0  # when the routers were last told them
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> int:
        """Replicas serving and routed to (a retiring one is not, nor one failed and being replaced)."""
        return sum(1 for c in self.state.routable if c.healthy)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()  # where its coroutines run (drain_last from another thread)
        while not self.fleet.closed and not self.state.draining:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - never let autoscaling die silently; the next round tries again
                log.exception("autoscaling round failed")

    async def step(self) -> None:
        """One round: a retiring replica's drain checked, then the policy asked and applied."""
        if self.state.draining:
            return  # the server is stopping: nothing to start (on a `ray up` cluster, a node to add)
        if self.state.retiring:
            await self._drain_step(max(self.state.retiring))
        if self._healing():
            self._export()  # the count serving changes as a replica fails and its replacement serves
            return
        adding = self._adding
        loads = await self._loads()
        if loads is None:
            return
        if adding is not None:
            # (one that joined while the figures came is counted from the next round: these are without it)
            if self._adding is not None:
                self._while_adding(loads)
            return
        decision = self.policy.decide(loads, self.clock(), self._held())
        if decision.wanted != self.wanted:
            if decision.why:  # else the count serving changed under it (a drain, an undrain): no decision
                log.warning("autoscaling: %d -> %d replica(s) wanted: %s", self.wanted, decision.wanted, decision.why)
            self.wanted = decision.wanted
        self._export()
        n = len(loads)
        if self.wanted > n:
            if self.state.retiring:  # the one draining takes load again: cheaper than a new one
                await self._resume(max(self.state.retiring))
            elif self.clock() >= self._retry_at and not self.state.draining:  # (it may have begun meanwhile)
                self._add()
        elif self.wanted < n and not self.state.retiring:
            await self.drain_last()

    def _while_adding(self, loads: list[ReplicaLoad]) -> None:
        """A round while a replica starts (on a `ray up` cluster it may wait minutes for a node; a start can
        hang): given up once the fleet has been idle as long as would remove a replica, and said now and
        then while it goes on."""
        self.policy.decide(loads, self.clock(), self._held())  # its idleness, kept counting
        now = self.clock()
        if self._abandoning:
            return
        idle = self.policy.idle_for(now)
        if idle is not None and idle >= self.policy.settings.down_delay_s and self.fleet.abandon_add():
            self._abandoning = True
            self.wanted = len(loads)
            self._export()
            log.warning(
                "autoscaling: replica %d is no longer wanted (idle for %.0f s): its start is given up",
                len(self.state.clients),
                idle,
            )
        elif now - self._adding_told >= _STARTING_TOLD_S:
            self._adding_told = now
            log.warning(
                "autoscaling: replica %d is still starting after %.0f s (waiting for resources, or loading)",
                len(self.state.clients),
                now - self._adding_since,
            )

    def _held(self) -> int:
        """Replicas drained by an operator: out of routing, but in the fleet (and on its GPUs) until undrained."""
        return sum(1 for c in self.state.clients if c.draining and c.replica_id not in self.state.retiring)

    def _healing(self) -> bool:
        """Whether the supervisor is replacing a replica (the fleet's figures mean little meanwhile)."""
        return any(not c.healthy for c in self.state.routable) or bool(self.supervisor.replacing)

    async def _loads(self) -> list[ReplicaLoad] | None:
        """Every routed replica's figures, asked at once; None when one did not answer in time."""
        clients = self.state.routable
        try:
            stats = await asyncio.wait_for(
                asyncio.gather(*(c.actor.stats.remote() for c in clients)), timeout=max(5.0, 5 * self.interval_s)
            )
        except Exception as e:  # noqa: BLE001 - a replica busy or failing: the health checks deal with it
            log.info("autoscaling: a replica's figures did not come (%s); next round", type(e).__name__)
            return None
        return [ReplicaLoad(s.waiting, s.running, s.queued_tokens, s.oldest_wait_s) for s in stats]

    def _export(self) -> None:
        size = (self.wanted, self.running)
        self.metrics.set(*size)
        self.state.metrics.fleet.set(*size)
        # told again now and then: a router Ray restarted starts without them
        if self.tier is not None and (size != self._size or self.clock() - self._told_at > _RETELL_S):
            self.tier.set_fleet_size(*size)
            self._told_at = self.clock()
        self._size = size

    # -- adding ----------------------------------------------------------------------------------

    def _add(self) -> None:
        future = self.fleet.add()
        if future is None:
            return
        self._adding = future
        self._adding_since = self._adding_told = self.clock()
        self._abandoning = False
        log.warning("autoscaling: starting replica %d", len(self.state.clients))
        asyncio.get_running_loop().create_task(self._install(future))

    async def _install(self, future: Future) -> None:
        try:
            new = await asyncio.wrap_future(future)
        except Exception as e:  # noqa: BLE001 - e.g. it died while starting: tried again while still wanted
            if self._abandoning:  # given up on purpose: no failure, and no wait before the next
                log.warning("autoscaling: the start given up has stopped")
                return
            self.failed_starts += 1
            self._backoff = min(2 * self._backoff, _MAX_BACKOFF_S)
            self._retry_at = self.clock() + self._backoff
            log.error("autoscaling: a new replica did not start (next try in %g s): %s", self._backoff, e)
            return
        finally:
            self._adding = None
        if new is None or self.fleet.closed:
            return  # when closed, the fleet shuts the new replica down with the others
        self._backoff = self.interval_s / 2
        # beside router actors this process routes nothing: no cache contents
        client = client_for(new, self.state.config, kv_events=self.tier is None)
        client.start()
        self.state.add_client(client)
        if self.tier is not None:
            await self.tier.add(new)
        self.added += 1
        self._export()
        log.warning("autoscaling: replica %d serves; %d replica(s) serving", new.replica_id, self.running)

    # -- removing --------------------------------------------------------------------------------

    async def drain_last(self) -> None:
        """Starts draining the last replica to remove it (the policy's scale-down; an operator's or a
        test's too): from now on no request is routed to it, and each round checks whether those it
        has are done. Not while another replica is draining, or the last is being replaced."""
        i = len(self.state.clients) - 1
        if self.state.retiring or self._adding is not None:
            return
        if i < 1 or i in self.supervisor.replacing:
            return
        self.state.retiring.add(i)
        if self.tier is not None:
            await self.tier.retire(i)
        self._export()
        log.warning("autoscaling: draining replica %d (no new requests; those it has finish)", i)

    async def _resume(self, i: int) -> None:
        self.state.resume(i)
        if self.tier is not None:
            await self.tier.retire(i, retiring=False)
        self._export()
        log.warning("autoscaling: replica %d takes requests again (load came back while it drained)", i)

    async def _drain_step(self, i: int) -> None:
        """Removes retiring replica i once nothing is left on it: no request any router sent it is
        unfinished, and its scheduler holds none. A retiring replica that failed is removed at once
        (its requests have ended with the failure already)."""
        client = self.state.clients[i]
        if client.healthy:
            if client.load:
                return
            if self.tier is not None and await self.tier.load(i) != 0:
                return
            try:
                stats = await asyncio.wait_for(client.actor.stats.remote(), timeout=max(5.0, 5 * self.interval_s))
            except Exception:  # noqa: BLE001 - the health checks say whether it failed
                return
            if stats.live:
                return
        if self.fleet.closed or i in self.supervisor.replacing:
            return
        # the routers forget it first, so that none sees its connection close as a failure
        self.state.clients.pop()
        self.state.retiring.discard(i)
        if self.tier is not None:
            await self.tier.removed(i)
        await client.stop()
        self.fleet.remove_last()
        self.removed += 1
        self._export()
        log.warning(
            "autoscaling: replica %d removed after its requests finished; %d replica(s) serving", i, self.running
        )
