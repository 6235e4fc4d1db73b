"""The router tier, from the launching process: `routers` RouterActors (router/tier/actor.py) on this node,
named raylm-router-PORT-K in Ray's dashboard, restarted by Ray when they die (a restarted one takes the
replicas serving now from the tier's directory). This side keeps the directory current, tells the
routers when a replica is replaced, and drains them when the server stops."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import ReplicaInfo, ServeConfig
from router.tier.actor import ReplicaRef, RouterActor, actor_id
from router.tier.directory import start_directory

log = logging.getLogger(__name__)


def ref_of(replica) -> ReplicaRef:
    return ReplicaRef(replica.replica_id, replica.actor)


class RouterTier:
    def __init__(self, config: ServeConfig, replicas: list, info: ReplicaInfo, state, interval_s: float = 1.0) -> None:
        """Starts the routers and waits until each serves on the port. `state`: the launching
        process's RouterState, whose clients (their health checked by its supervisor) say which
        replicas serve."""
        self.config, self.info, self.state, self.interval_s = config, info, state, interval_s
        self._closed = False
        self.replicas = [ref_of(r) for r in replicas]
        here = ray.get_runtime_context().get_node_id()  # SO_REUSEPORT shares a port on one node only
        # the routers' request metrics, summed over the tier by whichever router a scrape reaches
        self.metrics_dir = tempfile.mkdtemp(prefix=f"raylm-metrics-{config.port}-")
        self._node = here
        self.recreated = 0  # routers made anew after Ray gave up restarting them
        self.directory, self.actors = None, []
        try:
            self.directory = start_directory(config.port, config, info, self.replicas, self._on_this_node())
            self.actors = [self._create(k) for k in range(config.num_routers)]
            self.started = ray.get([a.ping.remote() for a in self.actors], timeout=300)
        except BaseException:
            self.shutdown()
            raise

    def _create(self, k: int):
        return (
            # a group of its own for stop_now, which must run while drain() blocks the actor's thread
            ray.remote(concurrency_groups={"control": 1})(RouterActor)
            .options(
                name=f"raylm-router-{self.config.port}-{k}",
                max_restarts=-1,
                max_task_retries=0,
                num_cpus=0,
                scheduling_strategy=self._on_this_node(),
                runtime_env={"env_vars": {"PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}},
            )
            .remote(self.config.port, k)
        )

    def _on_this_node(self) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(self._node, soft=False)

    def failed(self, replica_id: int, actor, why: str) -> None:
        """The supervisor found a replica failed: every router stops routing to it now (not waiting, as
        each would, for its channel's silence), until replaced() brings its replacement."""
        for router in self.actors:
            router.fail_replica.remote(replica_id, actor_id(actor), why)

    def replaced(self, i: int, replica) -> None:
        """Replica i's replacement serves: every router routes to it from now on."""
        self.replicas[i] = ref_of(replica)
        # in the directory first, waited for: a router restarting from now on starts on it, and the
        # calls below reach every one that started before (Ray holds a call to a restarting actor)
        try:
            ray.get(self.directory.set_replica.remote(i, self.replicas[i]), timeout=10)
        except Exception as e:  # noqa: BLE001 - its node gone with the routers': nothing left to start from it
            log.error("the tier's directory did not take replica %d: %s", i, e)
        for actor in self.actors:
            actor.set_replica.remote(i, self.replicas[i])

    # -- the autoscaler's, called from the launching process's event loop ---------------------------

    async def add(self, replica) -> None:
        """A replica joined the fleet: in the directory first (a router restarting from now on starts
        with it), then every router routes to it."""
        ref = ref_of(replica)
        self.replicas.append(ref)
        await self._every_router("add_replica", ref, directory=("add_replica", ref))

    async def retire(self, i: int, retiring: bool = True) -> None:
        """No router sends replica i (the last) a new request once this returns; retiring False: they
        route to it again."""
        if retiring:
            await self._every_router("retire_replica", i, True, directory=("remove_last_replica",))
        else:
            await self._every_router("add_replica", self.replicas[i], directory=("add_replica", self.replicas[i]))
            await self._every_router("retire_replica", i, False)

    async def load(self, i: int) -> int | None:
        """Requests the routers sent replica i that have not ended; None when a router did not answer
        (restarting: its predecessor's requests were released, but it may not have started yet)."""
        try:
            loads = await asyncio.wait_for(
                asyncio.gather(*(a.replica_load.remote(i) for a in self.actors)), timeout=10 * self.interval_s
            )
        except Exception:  # noqa: BLE001 - restarting or gone: the next round asks again
            return None
        return sum(loads)

    async def removed(self, i: int) -> None:
        """Replica i (the last, drained) has left the fleet."""
        self.replicas.pop()
        await self._every_router("remove_replica", i)

    def set_fleet_size(self, wanted: int, running: int) -> None:
        for actor in self.actors:
            actor.set_fleet_size.remote(wanted, running)

    async def _every_router(self, method: str, *args, directory: tuple = ()) -> None:
        """Calls the directory (`directory`: its method's name and arguments) when given, then `method`
        on every router, waiting for each; a router that fails to answer is restarting and starts from
        the directory."""
        if directory:
            try:
                await asyncio.wait_for(getattr(self.directory, directory[0]).remote(*directory[1:]), timeout=10)
            except Exception as e:  # noqa: BLE001 - restarted: the watch republishes self.replicas
                log.warning("the tier's directory did not take %s: %s", directory[0], e)
        calls = [getattr(a, method).remote(*args) for a in self.actors]
        for k, result in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, Exception):
                log.warning("router %d did not take %s: %s: %s", k, method, type(result).__name__, result)

    async def watch(self) -> None:
        """Keeps the directory published, notes a router's restart (its live gauges leave the tier's
        sums) and makes a router Ray gave up on anew. A router whose client of a serving replica failed
        (a transient error) gets it back."""
        while not self._closed:
            await asyncio.sleep(self.interval_s)
            await self._republish()
            for k, actor in enumerate(self.actors):
                try:
                    started = await asyncio.wait_for(actor.ping.remote(), timeout=10 * self.interval_s)
                    down = await asyncio.wait_for(actor.down_replicas.remote(), timeout=10 * self.interval_s)
                except ray.exceptions.ActorDiedError as e:
                    if not self._closed:  # Ray gave up on it (killed for good, or its restart raised): a new one
                        self._recreate(k, e)
                    continue
                except Exception:  # noqa: BLE001 - restarting: Ray brings it back, the next round sees it
                    continue
                if started != self.started[k]:
                    if self.started[k][1]:  # not one just made anew (logged then)
                        log.warning("router %d was restarted by Ray", k)
                    _forget_process(self.metrics_dir, self.started[k][1])
                    self.started[k] = started
                for i in down:  # a replica that serves, whose client at only that router failed
                    if i < len(self.state.clients) and self.state.clients[i].healthy:
                        actor.set_replica.remote(i, self.replicas[i], True)

    async def _republish(self) -> None:
        """A directory Ray restarted starts empty: it gets what the routers start from again."""
        try:
            if not await asyncio.wait_for(self.directory.published.remote(), timeout=10 * self.interval_s):
                serving = [r for r in self.replicas if r.replica_id not in self.state.retiring]
                await self.directory.publish.remote(self.config, self.info, serving)
                log.warning("the router tier's directory was restarted; published to it again")
        except Exception:  # noqa: BLE001 - restarting: the next round sees it back
            pass

    def _recreate(self, k: int, why: Exception) -> None:
        try:
            actor = self._create(k)
        except ValueError:  # its name is still held: Ray is restarting it after all; the next round sees
            return
        log.error("router %d is gone for good (%s); started a new one", k, str(why).splitlines()[0])
        _forget_process(self.metrics_dir, self.started[k][1])
        self.actors[k] = actor
        self.started[k] = (0.0, 0)  # the next round sees its start
        self.recreated += 1

    def drain_replica(self, i: int) -> int:
        """Every router stops routing to replica i and moves its streams there elsewhere; how many they had."""
        return sum(ray.get([a.drain_replica.remote(i) for a in self.actors], timeout=self.config.drain_timeout_s + 20))

    def undrain_replica(self, i: int) -> int:
        """Every router routes to replica i again; how many waiting requests they moved to it."""
        return sum(ray.get([a.undrain_replica.remote(i) for a in self.actors], timeout=60))

    def drain(self) -> None:
        """Each router stops taking requests and finishes those in flight (up to the drain timeout)."""
        self._closed = True
        try:
            ray.get([a.drain.remote() for a in self.actors], timeout=self.config.drain_timeout_s + 20)
        except Exception as e:  # noqa: BLE001 - a router gone mid-drain: its connections are closed already
            log.warning("draining the routers: %s: %s", type(e).__name__, e)

    def stop_now(self) -> None:
        """Each router ends its requests still running at once and stops (a drain waiting on them returns)."""
        for actor in getattr(self, "actors", []):
            actor.stop_now.remote()

    def shutdown(self) -> None:
        self._closed = True
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
        try:
            ray.kill(self.directory, no_restart=True)
        except Exception:  # noqa: BLE001 - never made, or gone already
            pass
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _forget_process(metrics_dir: str, pid: int) -> None:
    """A dead router's live gauges leave the tier's sums (its counters stay: they were counted)."""
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid, metrics_dir)
    except OSError:
        pass
