"""Bringing a deployment up and down: the replicas on Ray, the router state (and the router actors
when there are any), the supervisor, the autoscaler (with a replica range), and uvicorn."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import uvicorn

from cluster import Fleet, ReplicaHandle, ServeConfig, ensure_ray, load_tokenizer, local_ray_lost
from router.http.app import build_app
from router.http.connection import bounded_protocol
from router.http.draining import DrainingServer
from router.http.heap import freeze_startup_heap
from router.http.state import RouterState
from router.tier.autoscaler import Autoscaler
from router.tier.response_store import forget_responses
from router.tier.router_state import router_state
from router.tier.supervisor import Supervisor
from router.tier.tier import RouterTier

log = logging.getLogger(__name__)


class Deployment:
    """One deployment of the API: its replicas, its routers and the HTTP server over them."""

    def __init__(
        self, config: ServeConfig, on_ready: Callable[[Deployment], None] | None = None, **ray_options
    ) -> None:
        """Starts the replicas; `run` then serves. `on_ready(deployment)` is called once the API listens."""
        self.on_ready = on_ready
        config.validate()
        config.check_against_model()
        self.config = config
        tokenizer = load_tokenizer(config.model)
        if tokenizer is None:
            raise ValueError(f"{config.model} has no tokenizer files; the HTTP server needs one")
        # seconds of each part of the start, in order (launch.py prints them beside its "ready in")
        self.startup: dict[str, float] = {}
        t = time.monotonic()
        self.dashboard_url = ensure_ray(config.address, **ray_options)
        self.startup["Ray"] = time.monotonic() - t
        t = time.monotonic()
        self.ray_lost = False  # the local Ray went down with this process's group: nothing left to stop
        self.fleet = Fleet.start(config.replica_config(), config.initial_replicas)
        self.startup["replicas"] = time.monotonic() - t
        self.tier: RouterTier | None = None
        try:
            info = self.fleet.replicas[0].info
            # beside router actors this process only supervises: its clients need no cache contents
            self.state = router_state(config, tokenizer, info, self.fleet.replicas, kv_events=not config.num_routers)
            if config.num_routers:  # the router actors serve; this process supervises the replicas
                t = time.monotonic()
                self.tier = RouterTier(config, self.fleet.replicas, info, self.state)
                self.startup["router actors"] = time.monotonic() - t
            tier = self.tier
            self.supervisor = Supervisor(
                self.state,
                self.fleet,
                on_replaced=tier.replaced if tier is not None else None,
                on_failed=tier.failed if tier is not None else None,
            )
            background = [self.supervisor.run] + ([self.tier.watch] if self.tier is not None else [])
            self.autoscaler = (
                Autoscaler(self.state, self.fleet, self.supervisor, self.tier) if config.autoscaling else None
            )
            if self.autoscaler is not None:
                background.append(self.autoscaler.run)
            self.app = build_app(self.state, background=background)
        except BaseException:  # the replicas must not outlive a server that never started
            if self.tier is not None:
                self.tier.shutdown()
            self.fleet.shutdown()
            raise
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def replicas(self) -> list[ReplicaHandle]:
        """The replica serving each id (for inspecting them: their actors and followers)."""
        return self.fleet.replicas

    def drain_replica(self, i: int) -> int:
        """Takes replica i out of routing with its streams in flight moved to the other replicas, unbroken
        (those that may not move, with max_migrations 0 or used up, left to finish on it); returns once
        no router has a request on it, with how many streams it had. The replica still runs: stop,
        replace or undrain it after (`undrain_replica`). Callable from any thread."""
        had = self.state.drain_replica_from_thread(i, self.config.drain_timeout_s + 10)
        if self.tier is not None:
            had += self.tier.drain_replica(i)
        return had

    def undrain_replica(self, i: int) -> int:
        """Routes to replica i again once drain_replica returned, every router handing it some of the requests
        that wait on the others (with rebalance_on_join); returns how many moved. Callable from any thread."""
        moved = self.state.undrain_replica_from_thread(i, 30)
        if self.tier is not None:
            moved += self.tier.undrain_replica(i)
        return moved

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _make_uvicorn(self) -> uvicorn.Server:
        c = self.config
        # with router actors on the port, this process serves the supervisor alone, on no socket
        cfg = uvicorn.Config(
            self.app,
            host=c.host,
            port=c.port,
            log_level="warning",
            timeout_graceful_shutdown=c.drain_timeout_s,
            access_log=False,
            # longer than clients keep idle connections (httpx: 5 s) by default, so the
            # server never closes one just as a client sends on it
            timeout_keep_alive=c.keep_alive_timeout_s,
            http=bounded_protocol(c.header_timeout_s, c.max_connections),
        )
        on_ready = (lambda: self.on_ready(self)) if self.on_ready is not None else None
        if self.tier is not None:
            self._uvicorn = _TierDriver(cfg, self.state, self.config.drain_timeout_s, on_ready, self.tier)
        else:
            self._uvicorn = DrainingServer(cfg, self.state, self.config.drain_timeout_s, on_ready)
        return self._uvicorn

    def run(self) -> None:
        """Serves until SIGINT or SIGTERM, lets requests in flight finish (up to the drain timeout),
        then stops every replica and returns."""
        freeze_startup_heap()  # this process serves from here on: no full collection walks its startup
        if threading.current_thread() is not threading.main_thread():  # no signals here: uvicorn's way
            try:
                self._make_uvicorn().run()
            finally:
                self.shutdown_replicas()
            return
        # uvicorn re-raises the signal that stopped it once it has drained; with the default handler
        # in place that would end the process before the replicas are stopped in order. A signal that
        # arrives while they are being stopped ends the process at once (Ray then removes the actors of
        # the dead driver).
        state = {"serving": True}

        def on_signal(sig: int, _frame) -> None:
            if state["serving"]:
                return  # uvicorn's re-raise of what stopped it
            log.warning("%s while stopping the replicas: exiting now", signal.Signals(sig).name)
            os._exit(128 + sig)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._make_uvicorn().run()
        finally:
            state["serving"] = False
            try:
                self.shutdown_replicas()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def start_in_thread(self, timeout_s: float = 60.0) -> str:
        server = self._make_uvicorn()
        server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:  # the router actors' drain has its own margin (router/tier/tier.py)
            self._thread.join(timeout=self.config.drain_timeout_s + (30 if self.tier is not None else 10))
        self.shutdown_replicas()

    def shutdown_replicas(self) -> None:
        """Stops the router actors (drained already on a normal stop), then every replica, and any
        replacement still being built. Idempotent. Nothing to stop where the local Ray went down with this
        process's group (its actors went with it)."""
        if local_ray_lost():
            log.warning("the local Ray stopped with this process (a signal to its process group): nothing to stop")
            self.ray_lost = True
            return
        if self.tier is not None:
            self.tier.shutdown()
        forget_responses(self.config.port)
        self.fleet.shutdown()


class _TierDriver(DrainingServer):
    """The launching process when router actors serve: no socket of its own (they hold the port), the
    supervisor on its event loop; once stopped it drains the router actors."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: RouterState,
        drain_timeout_s: float,
        on_ready: Callable[[], None] | None,
        tier: RouterTier,
    ) -> None:
        super().__init__(config, state, drain_timeout_s, on_ready)
        self.tier = tier

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[])

    def _force(self) -> None:
        super()._force()
        self.tier.stop_now()  # the routers hold the requests; their drain, which shutdown waits on, then ends

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        await asyncio.get_running_loop().run_in_executor(None, self.tier.drain)
        await uvicorn.Server.shutdown(self, sockets)
