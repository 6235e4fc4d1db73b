"""The supervisor's replacement policy on its own (no Ray): a replica that cannot be started again,
e.g. on a cluster short of GPUs, is retried with growing waits instead of every round."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import router.supervisor as supervisor_module
from router.supervisor import Supervisor


class _DownClient:
    healthy = False
    error = "replica 0 failed: RayActorError"

    async def stop(self) -> None:
        pass


def test_a_replacement_that_cannot_start_is_retried_with_growing_waits(monkeypatch):
    attempts: list[float] = []

    class NoRoom:
        def __init__(self, config, replica_id, abandon=None) -> None:
            attempts.append(time.monotonic())
            raise TimeoutError("the cluster has not had 1 free GPU bundles")

    monkeypatch.setattr(supervisor_module, "ReplicaHandle", NoRoom)
    server = SimpleNamespace(state=SimpleNamespace(clients=[_DownClient()], draining=False),
                             replicas=[SimpleNamespace(config=None, shutdown=lambda: None)],
                             config=SimpleNamespace(health_check_timeout_s=1.0))
    supervisor = Supervisor(server, interval_s=0.05)

    async def supervise_for(seconds: float) -> None:
        try:
            await asyncio.wait_for(supervisor.run(), seconds)
        except asyncio.TimeoutError:
            pass

    asyncio.run(supervise_for(2.0))
    supervisor.close()
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    # every round (0.05 s) would be about 40 tries; doubling waits from 0.05 s give about 6
    assert 3 <= len(attempts) <= 10, attempts
    assert gaps[-1] >= 4 * gaps[0], gaps
    assert supervisor.restarts == 0
