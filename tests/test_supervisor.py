"""The supervisor's replacement policy and the fleet's replica lifecycle on their own (no Ray): a
replica that cannot be started again, e.g. on a cluster short of GPUs, is retried with growing waits
instead of every round; a replacement is built on a fleet thread, then routed to; shutting the fleet
down leaves no replacement running."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from cluster.fleet.fleet import Fleet
from router.http.state import RouterState
from router.tier.supervisor import Supervisor


class _DownClient:
    healthy = False
    draining = False  # an operator's drain, which its replacement keeps
    error = "replica 0 failed: RayActorError"

    async def stop(self) -> None:
        pass


def test_a_replacement_that_cannot_start_is_retried_with_growing_waits():
    attempts: list[float] = []

    class NoRoom:
        def __init__(self, config, replica_id, abandon=None) -> None:
            attempts.append(time.monotonic())
            raise TimeoutError("the cluster has not had 1 free GPU bundles")

    fleet = Fleet(None, [SimpleNamespace(replica_id=0, shutdown=lambda graceful_s=30.0: None)], build=NoRoom)
    state = SimpleNamespace(
        clients=[_DownClient()], draining=False, retiring=set(), config=SimpleNamespace(health_check_timeout_s=1.0)
    )
    supervisor = Supervisor(state, fleet, interval_s=0.05)

    async def supervise_for(seconds: float) -> None:
        try:
            await asyncio.wait_for(supervisor.run(), seconds)
        except TimeoutError:
            pass

    asyncio.run(supervise_for(2.0))
    fleet.shutdown()
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    # every round (0.05 s) would be about 40 tries; doubling waits from 0.05 s give about 6
    assert 3 <= len(attempts) <= 10, attempts
    assert gaps[-1] >= 4 * gaps[0], gaps
    assert supervisor.restarts == 0


class _Replica:
    def __init__(self, replica_id: int = 0) -> None:
        self.replica_id, self.down = replica_id, False
        # a channel that takes its time to open: the client stays connecting until the test stops it
        self.actor = SimpleNamespace(
            channel_address=SimpleNamespace(remote=lambda: asyncio.sleep(3600)),
            kv_subscribe=SimpleNamespace(remote=lambda subscriber: asyncio.sleep(0)),
            health=SimpleNamespace(remote=lambda: asyncio.sleep(0, None)),
        )
        self.info = None
        self.hung = 0.0  # seconds a request to stop goes unanswered

    def shutdown(self, graceful_s: float = 30.0) -> None:
        self.down, self.graceful_s = True, graceful_s
        if graceful_s > 0 and self.hung:  # waits for a scheduler that never answers, as ReplicaHandle's does
            time.sleep(self.hung)


def test_a_replacement_is_built_on_a_fleet_thread_then_routed_to():
    built: list[tuple[_Replica, str]] = []

    def build(config, replica_id, abandon=None) -> _Replica:
        built.append((_Replica(replica_id), threading.current_thread().name))
        return built[-1][0]

    old = _Replica()
    fleet = Fleet(None, [old], build=build)
    state = RouterState(
        config=SimpleNamespace(health_check_timeout_s=1.0, rebalance_on_join=True),
        tokenizer=None,
        model_name="m",
        max_seq_len=8,
        vocab_size=8,
        clients=[_DownClient()],
    )
    supervisor = Supervisor(state, fleet, interval_s=0.05)

    async def supervise_until_replaced() -> None:
        task = asyncio.get_running_loop().create_task(supervisor.run())
        while supervisor.restarts == 0:
            await asyncio.sleep(0.05)
        task.cancel()
        await state.clients[0].stop()

    asyncio.run(asyncio.wait_for(supervise_until_replaced(), 10))
    fleet.shutdown()
    assert old.down and old.graceful_s == 0  # failed: killed, not asked to stop and waited for
    assert len(built) == 1
    new, thread = built[0]
    assert thread.startswith("replica-rebuild")  # never the event loop's default executor
    assert state.clients[0].actor is new.actor and fleet.replicas == []
    assert new.down


def test_shutting_down_abandons_a_replacement_waiting_for_resources():
    waiting = threading.Event()

    def build(config, replica_id, abandon=None) -> _Replica:
        waiting.set()
        abandon.wait()
        raise RuntimeError("abandoned while waiting for resources")

    fleet = Fleet(None, [_Replica()], build=build)
    fleet.replace(0)
    assert waiting.wait(5)
    start = time.monotonic()
    fleet.shutdown()
    assert time.monotonic() - start < 5
    assert fleet.replace(0) is None  # no replacement starts once shut down


def test_ctrl_c_while_the_fleet_starts_abandons_the_replicas_still_waiting_for_resources():
    # Ctrl-C reaches the start as a KeyboardInterrupt out of the first replica's result (raised by its build
    # here: the same path as a signal's, without a signal's timing): replica 1 is started already, replica
    # 2 waits for resources
    first, first_built, waiting, waited = _Replica(1), threading.Event(), threading.Event(), threading.Semaphore(0)

    def build(config, replica_id, abandon=None) -> _Replica:
        if replica_id == 1:
            first_built.set()
            return first
        if replica_id == 0:
            assert first_built.wait(5) and waiting.wait(5)
            raise KeyboardInterrupt
        waiting.set()
        assert abandon.wait(10), "not abandoned"  # as ReplicaHandle's wait for its placement gives up
        waited.release()
        raise RuntimeError("abandoned while waiting for resources")

    start = time.monotonic()
    try:
        Fleet.start(None, 3, build=build)
        raise AssertionError("the interrupt did not stop the start")
    except KeyboardInterrupt:
        pass
    assert waited.acquire(timeout=5), "the build waiting for resources was not abandoned"
    assert time.monotonic() - start < 5
    assert first.down  # the replica started is shut down


def test_a_replacement_that_comes_up_after_shutdown_is_shut_down_too():
    release, built = threading.Event(), []

    def build(config, replica_id, abandon=None) -> _Replica:
        release.wait()
        built.append(_Replica(replica_id))
        return built[-1]

    fleet = Fleet(None, [_Replica()], build=build)
    future = fleet.replace(0)
    fleet.shutdown(timeout_s=0.1)  # gives up waiting for it
    release.set()
    assert future.result(timeout=5) is None
    assert built[0].down


class _SilentClient:
    """A replica client whose health check finds the replica failed."""

    replica_id, actor = 3, "actor-3"

    def __init__(self) -> None:
        self.error = None

    @property
    def healthy(self) -> bool:
        return self.error is None

    async def check_health(self) -> str | None:
        return "replica 3 has not answered a health check in 1 s"

    def mark_failed(self, why: str) -> None:
        self.error = why

    async def stop(self) -> None:
        pass


def test_a_failed_health_check_is_told_to_the_router_actors_with_the_replica_it_found():
    told: list[tuple] = []
    client = _SilentClient()
    state = SimpleNamespace(
        clients=[client], draining=True, retiring=set(), config=SimpleNamespace(health_check_timeout_s=1.0)
    )
    fleet = SimpleNamespace(closed=False)
    supervisor = Supervisor(state, fleet, interval_s=0.05, on_failed=lambda *failed: told.append(failed))

    async def supervise_until_told() -> None:
        task = asyncio.get_running_loop().create_task(supervisor.run())
        while not told:
            await asyncio.sleep(0.05)
        fleet.closed = True
        await task

    asyncio.run(asyncio.wait_for(supervise_until_told(), 10))
    assert told == [(3, "actor-3", "replica 3 has not answered a health check in 1 s")]
    assert client.error == told[0][2]


def test_a_fleet_shuts_its_replicas_down_at_once_not_one_after_another():
    """Each replica's scheduler is given its time to stop together: hung ones cost that time once."""
    replicas = [_Replica(i) for i in range(3)]
    for r in replicas:
        r.hung = 1.0
    fleet = Fleet(None, replicas, build=None)
    start = time.monotonic()
    fleet.shutdown()
    assert all(r.down and r.graceful_s > 0 for r in replicas)
    assert time.monotonic() - start < 2.5  # 3 s one after another
