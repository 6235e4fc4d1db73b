"""One HTTP ingress of the router tier: a Ray actor that serves the whole API (tokenizing, routing,
detokenizing, SSE) on the deployment's port, beside the tier's other actors on this node: each binds
its own listening socket with SO_REUSEPORT, and the kernel spreads new connections over them, so
clients see one endpoint and the per-token work runs in as many processes as there are routers.

Ray restarts an actor that dies (its clients' connections close with it). A started router takes its
settings and the replicas serving now from the tier's directory (router/tier/directory.py), releases
what its predecessor of the same index had sent (the replicas abort those requests: no one reads them
any more), then serves. The driver (router/tier/tier.py) tells each router when a replica is replaced."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import ray
import uvicorn

from cluster import load_tokenizer
from router.http.app import build_app
from router.http.connection import bounded_protocol
from router.http.draining import DrainingServer
from router.http.heap import freeze_startup_heap
from router.http.state import RouterState
from router.replicas.client import client_for
from router.tier.directory import read_directory
from router.tier.router_state import router_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaRef:
    """What a router needs of a replica: its id and its scheduler actor."""

    replica_id: int
    actor: object


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port that other processes on this node may bind too."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class RouterActor:
    def __init__(self, port: int, index: int) -> None:
        """Serves at once (so that a restart by Ray serves again without the driver) the deployment on
        `port`: `index` is this router's place in the tier, and its subscriber id on the replicas is
        index + 1 (0 is the launching process's). Only these two plain numbers are its arguments, so
        that Ray can restart it from them alone."""
        config, info, replicas = read_directory(port)
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config, self.index, self.subscriber = config, index, index + 1
        tokenizer = load_tokenizer(config.model)
        # each incarnation draws ids from its own range: its predecessor's may still be finishing (or
        # remembered as aborted) on a replica it could not reach
        first_uid = (self.subscriber << 48) | (_next_incarnation(config.port, index) << 32)
        self.state: RouterState = router_state(config, tokenizer, info, replicas, self.subscriber, first_uid)
        self._release_predecessor(replicas)
        freeze_startup_heap()  # a router actor serves for the rest of its life
        uv = uvicorn.Config(
            build_app(self.state),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=config.drain_timeout_s,
            timeout_keep_alive=config.keep_alive_timeout_s,
            http=bounded_protocol(config.header_timeout_s, config.max_connections),
        )
        self._server = DrainingServer(uv, self.state, config.drain_timeout_s)
        self._server.install_signal_handlers = lambda: None  # not the main thread; the driver drains the tier
        self._loop: asyncio.AbstractEventLoop | None = None
        sock = listening_socket(config.host, config.port)
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="router-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"router {index} did not start serving on {config.host}:{config.port}")
            time.sleep(0.02)
        self.started_at = time.time()

    def _release_predecessor(self, replicas: list[ReplicaRef]) -> None:
        for ref in replicas:
            self._release(ref)

    def _release(self, ref: ReplicaRef) -> None:
        """What an earlier incarnation of this router (or this one, over a client given up) left on the
        replica is aborted there."""
        import ray

        try:
            n = ray.get(ref.actor.release_subscriber.remote(self.subscriber), timeout=30)
        except Exception as e:  # noqa: BLE001 - a replica being replaced: its requests died with it
            log.warning("router %d: replica %d did not answer (%s)", self.index, ref.replica_id, type(e).__name__)
            return
        if n:
            log.warning(
                "router %d: replica %d aborted %d request(s) this router had sent", self.index, ref.replica_id, n
            )

    def _serve(self, sock: socket.socket) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve(sockets=[sock]))

    # -- called through Ray ------------------------------------------------------------------------

    def ping(self) -> tuple[float, int]:
        """When this incarnation started serving (a restart by Ray changes it), and its process id."""
        return self.started_at, os.getpid()

    def in_flight(self) -> int:
        """Requests this router has on the replicas now."""
        return sum(c.load for c in self.state.clients)

    def admitted(self) -> int:
        """Request ids issued so far by this incarnation (one per request and choice)."""
        return self.state.uids.issued

    def down_replicas(self) -> list[int]:
        """The replicas this router has stopped routing to (its client of each failed)."""
        return [i for i, c in enumerate(self.state.clients) if not c.healthy]

    def set_replica(self, i: int, ref: ReplicaRef, repair: bool = False) -> None:
        """Routes replica i's traffic to ref from now on: its replacement serves, or (repair) the
        replica serves and this router's client of it had failed (a transient error)."""
        old = self.state.clients[i]
        if actor_id(old.actor) == actor_id(ref.actor) and not (repair and not old.healthy):
            return  # the push after a restart repeats the replicas that did not change
        self._release(ref)  # a predecessor's requests there, or the failed client's

        async def install() -> None:
            client = client_for(ref, self.config, self.subscriber)
            client.start()
            self.state.set_client(i, client)
            await old.stop()

        if self._loop is None or not self._loop.is_running():
            return  # draining or stopped: there is nothing to route any more
        asyncio.run_coroutine_threadsafe(install(), self._loop).result(timeout=30)

    def fail_replica(self, replica_id: int, incarnation: object, why: str) -> None:
        """The launching process's supervisor found a replica (`incarnation`: its actor's id) failed: this
        router stops routing to it and moves its streams elsewhere now, not once its own channel has
        been silent long enough to say so (a replica hung with its channel open never is)."""

        async def mark() -> None:
            for client in self.state.clients:
                if client.replica_id == replica_id and client.healthy and actor_id(client.actor) == incarnation:
                    client.mark_failed(why)

        self._on_loop(mark())

    def drain_replica(self, i: int) -> int:
        """Stops routing to replica i and moves this router's streams on it elsewhere (RouterState.drain_replica);
        how many it had there."""
        return self.state.drain_replica_from_thread(i, self.config.drain_timeout_s + 10)

    def undrain_replica(self, i: int) -> int:
        """Routes to replica i again (RouterState.undrain_replica); how many waiting requests moved to it."""
        return self.state.undrain_replica_from_thread(i, 30)

    # -- the autoscaler's: a replica joins at the end, or retires from it ---------------------------

    def add_replica(self, ref: ReplicaRef) -> None:
        """Routes to a replica that joined the fleet (after a restart, one the directory held already
        is not added twice)."""
        if any(c.replica_id == ref.replica_id for c in self.state.clients):
            return

        async def install() -> None:
            client = client_for(ref, self.config, self.subscriber)
            client.start()
            self.state.add_client(client)

        self._on_loop(install())

    def retire_replica(self, i: int, retiring: bool = True) -> None:
        """Stops (or, retiring False, resumes) sending new requests to replica i; those it has finish.
        Once this returns, nothing more is sent to it."""

        async def mark() -> None:
            if retiring:
                self.state.retiring.add(i)
            else:
                self.state.resume(i)

        self._on_loop(mark())

    def replica_load(self, i: int) -> int:
        """Requests this router sent replica i that have not ended (their last delta not received)."""
        return next((c.load for c in self.state.clients if c.replica_id == i), 0)

    def remove_replica(self, i: int) -> None:
        """Forgets replica i, which has left the fleet (drained: nothing of this router's is on it)."""

        async def remove() -> None:
            gone = [c for c in self.state.clients if c.replica_id == i]
            self.state.clients[:] = [c for c in self.state.clients if c.replica_id != i]
            self.state.retiring.discard(i)
            for client in gone:
                await client.stop()

        self._on_loop(remove())

    def set_fleet_size(self, wanted: int, running: int) -> None:
        """The autoscaler's figures, for this router's /metrics."""
        self.state.metrics.fleet.set(wanted, running)

    def _on_loop(self, coro) -> None:
        """Runs coro on the router's event loop (where its clients live) and waits for it."""
        if self._loop is None or not self._loop.is_running():
            coro.close()
            return  # draining or stopped: there is nothing to route any more
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def drain(self) -> None:
        """Stops taking requests and lets those in flight finish (up to the drain timeout), then returns."""
        self._server.should_exit = True
        self._thread.join(timeout=self.config.drain_timeout_s + 10)

    @ray.method(concurrency_group="control")
    def stop_now(self) -> None:
        """Ends the requests still running at once (in order: 503s and SSE error events) and stops serving: a
        second Ctrl-C at the driver, while drain() waits on this actor's other thread."""
        self._server.stop_now()


def actor_id(actor) -> object:
    """An actor handle's id (what identifies one incarnation of a replica across processes)."""
    return getattr(actor, "_actor_id", actor)


def _next_incarnation(port: int, index: int) -> int:
    """How many times router `index` of the deployment on `port` has started, this time counted (kept
    in Ray's control store, so a restart by Ray counts on), modulo 2**16."""
    from ray.experimental import internal_kv

    key = f"raylm-router-{port}-{index}-incarnation".encode()
    n = (int(internal_kv._internal_kv_get(key) or 0) + 1) % (1 << 16)
    internal_kv._internal_kv_put(key, str(n).encode(), overwrite=True)
    return n
