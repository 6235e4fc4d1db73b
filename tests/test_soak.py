"""A soak: hundreds of requests of random lengths, streaming and not, a fifth of the clients
disconnecting part-way. Afterwards every replica is whole, idle, and has not grown."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import ray
from helpers import serving
from test_serve import wait_until_idle

REQUESTS = 500
WARMUP = 100
CONCURRENCY = 48


@pytest.fixture(scope="module")
def soaked(ray_cluster, qwen3_path):
    with serving(qwen3_path, replicas=2, num_pages=300, max_running_reqs=32) as srv:
        yield srv


async def traffic(url: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    counts = {"ok": 0, "left": 0}
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))],
                "max_tokens": rng.randint(1, 12),
                "temperature": rng.choice([0, 0.7]),
                "stream": rng.random() < 0.5,
            }
            leave = rng.random() < 0.2
            async with sem:
                if body["stream"]:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if leave and line.startswith("data: {"):
                                counts["left"] += 1
                                return  # closing the stream here is the disconnect
                    counts["ok"] += 1
                elif leave:  # its own connection: a request cancelled mid-flight must not touch the shared pool
                    async with httpx.AsyncClient(base_url=url, timeout=60) as own:
                        try:
                            await asyncio.wait_for(own.post("/v1/completions", json=body), timeout=0.01)
                            counts["ok"] += 1
                        except TimeoutError:
                            counts["left"] += 1
                else:
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    counts["ok"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return counts


def test_soak_leaves_every_replica_whole_idle_and_no_bigger(soaked):
    asyncio.run(traffic(soaked.url, WARMUP, seed=1))
    before = wait_until_idle(soaked, 60)
    counts = asyncio.run(traffic(soaked.url, REQUESTS, seed=2))
    after = wait_until_idle(soaked, 60)
    assert counts["ok"] + counts["left"] == REQUESTS and counts["left"] > REQUESTS // 10
    assert [s.live for s in after] == [0, 0] and [s.running for s in after] == [0, 0]
    assert [s.request_slots_free for s in after] == [s.request_slots_total for s in after]
    ray.get([r.actor.check_integrity.remote() for r in soaked.replicas])
    for b, a in zip(before, after):
        assert a.rss_bytes - b.rss_bytes < 64 * 2**20, (b.rss_bytes, a.rss_bytes)
    assert httpx.get(soaked.url + "/health").status_code == 200
