"""Keeps the replicas serving: a replica whose scheduler actor died, or whose tensor-parallel group
broke (a follower died, a collective timed out), is taken out of routing at once and replaced with a
fresh one placed by Ray; traffic returns to it when it is ready."""

from __future__ import annotations

import asyncio
import logging

from cluster.deploy import ReplicaHandle
from router.replica_client import ReplicaClient

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, server, interval_s: float = 1.0) -> None:
        self.server, self.interval_s = server, interval_s
        self.restarts = 0
        self._replacing: set[int] = set()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for i, client in enumerate(self.server.state.clients):
                if client.healthy and not await client.answers_ping():
                    client.mark_failed(f"replica {client.replica_id} stopped answering or lost a rank")
                if not client.healthy and i not in self._replacing:
                    self._replacing.add(i)
                    asyncio.get_running_loop().create_task(self._replace(i))

    async def _replace(self, i: int) -> None:
        server = self.server
        old = server.replicas[i]
        log.warning("replacing replica %d", i)
        try:
            await server.state.clients[i].stop()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, old.shutdown)
            new = await loop.run_in_executor(None, ReplicaHandle, old.config, i)
        except Exception as e:  # noqa: BLE001 - try again on the next round
            log.error("replica %d could not be replaced: %s", i, e)
            self._replacing.discard(i)
            return
        client = ReplicaClient(i, new.actor, new.info)
        client.start()
        server.replicas[i] = new
        server.state.clients[i] = client
        self.restarts += 1
        self._replacing.discard(i)
        log.warning("replica %d is serving again", i)
