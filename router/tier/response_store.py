"""The Responses API's stored responses, in one Ray actor that every router of the tier reaches by name
(raylm-responses-PORT), so that a response stored through one router continues through another. Each
is kept for a while (ttl_s) and the store is bounded (max_responses, max_bytes): the oldest go first."""

from __future__ import annotations

import time
from collections import OrderedDict

import ray

# a response continues a conversation within the hour; the bounds keep a busy server's memory in check
TTL_S = 3600.0
MAX_RESPONSES = 10_000
MAX_BYTES = 256 << 20


class ResponseStore:
    def __init__(self, ttl_s: float = TTL_S, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.ttl_s, self.max_responses, self.max_bytes = ttl_s, max_responses, max_bytes
        self._items: OrderedDict[str, tuple[float, int, dict]] = OrderedDict()  # id -> (stored at, size, record)
        self._bytes = 0

    def put(self, response_id: str, record: dict, size: int) -> None:
        self._evict()
        self.delete(response_id)
        self._items[response_id] = (time.monotonic(), size, record)
        self._bytes += size
        while self._items and (len(self._items) > self.max_responses or self._bytes > self.max_bytes):
            self._pop(next(iter(self._items)))

    def get(self, response_id: str) -> dict | None:
        self._evict()
        item = self._items.get(response_id)
        return None if item is None else item[2]

    def delete(self, response_id: str) -> bool:
        if response_id not in self._items:
            return False
        self._pop(response_id)
        return True

    def _pop(self, response_id: str) -> None:
        self._bytes -= self._items.pop(response_id)[1]

    def _evict(self) -> None:
        now = time.monotonic()
        while self._items and now - next(iter(self._items.values()))[0] > self.ttl_s:
            self._pop(next(iter(self._items)))


def response_store(port: int):
    """The tier's store actor, made by the first router that needs it. Detached: it outlives that
    router (another router actor of the tier may still read it after that one dies); the server's stop
    ends it (forget_responses)."""
    return (
        ray.remote(ResponseStore)
        .options(name=f"raylm-responses-{port}", get_if_exists=True, num_cpus=0, max_restarts=-1, lifetime="detached")
        .remote()
    )


def forget_responses(port: int) -> None:
    """Stops the tier's store (the server stops: its responses go with it). Idempotent."""
    try:
        ray.kill(ray.get_actor(f"raylm-responses-{port}"), no_restart=True)
    except (ValueError, ray.exceptions.RaySystemError):  # never made, or gone already
        pass
