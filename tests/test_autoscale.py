"""Autoscaling on real Ray (CPU, a tiny checkpoint, short delays), over one server whose fleet may
range from 1 to 3 replicas: a burst grows it to 3 and idleness brings it back to 1 with every request
completed in full; a drain for scale-down lets the streams on the replica leaving finish (nothing is
cut, nothing new is routed to it); a replica that dies during its own start is started again until the
fleet has the count wanted. Each test leaves the fleet at one replica."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from conftest import live_ray_objects
from helpers import migrations_counted, serving

from cluster.fleet.autoscale import AutoscalePolicy

pytestmark = pytest.mark.usefixtures("ray_cluster")

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(4 + i % 4)] for i in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def srv(qwen3_path, ray_cluster):
    with serving(
        qwen3_path,
        min_replicas=1,
        max_replicas=3,
        autoscale_queue_per_replica=1,
        autoscale_up_delay_s=0.0,
        autoscale_down_delay_s=1.0,
        max_running_reqs=2,  # a few streams at once keep requests waiting on one replica
        num_pages=128,
    ) as srv:
        srv.autoscaler.interval_s = 0.2
        yield srv


def _set_policy(srv, **changes) -> None:
    """The server's autoscaling settings, some changed (a fresh policy: its clocks start again)."""
    settings = dataclasses.replace(srv.autoscaler.policy.settings, **changes)
    srv.autoscaler.policy = AutoscalePolicy(settings)


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


@dataclasses.dataclass
class Stream:
    prompt: int
    text: str
    finish_reason: str | None
    tokens: int


async def _stream(client: openai.AsyncOpenAI, prompt: int, max_tokens: int) -> Stream:
    chunks = await client.completions.create(
        model="tiny",
        prompt=PROMPTS[prompt],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, tokens = [], None, 0
    async for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Stream(prompt, "".join(text), finish, tokens)


def _feed_until(
    srv, condition: Callable[[], bool], what: str, concurrency: int = 8, max_tokens: int = MAX_TOKENS
) -> list[Stream]:
    """Keeps `concurrency` greedy streams in flight until condition holds, then lets them finish;
    every stream's result."""

    async def feed() -> list[Stream]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        results, pending, sent = [], set(), 0
        deadline = time.monotonic() + 180
        while not condition():
            assert time.monotonic() < deadline, f"not within 180 s: {what}"
            while len(pending) < concurrency:
                pending.add(asyncio.ensure_future(_stream(client, sent % len(PROMPTS), max_tokens)))
                sent += 1
            done, pending = await asyncio.wait(pending, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            results += [t.result() for t in done]
        results += await asyncio.gather(*pending)
        await client.close()
        return results

    return asyncio.run(feed())


async def _streams(srv, n: int, max_tokens: int = MAX_TOKENS) -> list[Stream]:
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_stream(client, i % len(PROMPTS), max_tokens) for i in range(n)))


def _assert_complete(streams: list[Stream], max_tokens: int = MAX_TOKENS) -> None:
    """Every stream ran to its length, and greedy streams of one prompt agree whichever replica ran them."""
    assert streams
    assert all(s.finish_reason == "length" and s.tokens == max_tokens for s in streams), [
        s for s in streams if s.finish_reason != "length" or s.tokens != max_tokens
    ]
    for p in range(len(PROMPTS)):
        assert len({s.text for s in streams if s.prompt == p}) <= 1, p


def _assert_one_replica_left(srv) -> None:
    import ray

    _wait_for(
        lambda: len(srv.state.clients) == len(srv.replicas) == 1 and not srv.state.retiring,
        "the fleet back at one replica",
    )
    replica = srv.replicas[0]
    ray.get(replica.actor.check_integrity.remote())
    assert ray.get(replica.actor.stats.remote()).live == 0
    _wait_for(  # (another server of this module may hold a replica 0 too)
        lambda: (
            f"raylm-replica-0-{replica.suffix}" in (groups := live_ray_objects()[1])
            and not [g for g in groups if g.startswith("raylm-replica-") and not g.startswith("raylm-replica-0-")]
        ),
        "the removed replicas' placement groups gone",
        timeout_s=60,
    )


def _gauge(text: str, name: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(name + "{")).split()[-1])


def test_a_burst_grows_the_fleet_to_three_replicas_and_idleness_brings_it_back_to_one(srv, ray_metrics_port, caplog):
    caplog.set_level(logging.WARNING, logger="router.tier.autoscaler")
    added, removed = srv.autoscaler.added, srv.autoscaler.removed
    streams = _feed_until(srv, lambda: len(srv.state.clients) == 3, "three replicas serving")
    assert srv.autoscaler.added - added == 2
    _assert_complete(streams)
    _assert_one_replica_left(srv)
    assert srv.autoscaler.removed - removed == 2 and srv.autoscaler.wanted == 1
    decisions = [r.getMessage().split(":")[1].strip() for r in caplog.records if "wanted" in r.getMessage()]
    assert decisions == [f"{a} -> {b} replica(s) wanted" for a, b in ((1, 2), (2, 3), (3, 2), (2, 1))], decisions
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert _gauge(metrics, "raylm:replicas_wanted") == 1 and _gauge(metrics, "raylm:replicas_running") == 1

    def exported_by_ray() -> tuple[float, float] | None:  # Ray's metrics agent exports every few seconds
        text = httpx.get(f"http://127.0.0.1:{ray_metrics_port}/metrics", timeout=30).text
        try:
            return _gauge(text, "ray_raylm_replicas_wanted"), _gauge(text, "ray_raylm_replicas_running")
        except StopIteration:
            return None

    _wait_for(lambda: exported_by_ray() == (1, 1), "Ray's export of the fleet's gauges", timeout_s=60)


def test_a_drain_for_scale_down_lets_the_streams_on_the_leaving_replica_finish(srv):
    _set_policy(srv, max_replicas=2, down_delay_s=3600.0)  # this test drains; the policy only grows
    try:

        def second_replica_has_streams() -> bool:
            clients = srv.state.clients
            return len(clients) == 2 and clients[1].load >= 2

        before = _feed_until(srv, second_replica_has_streams, "streams on a second replica", max_tokens=48)
        # the streams above were let finish; now some that are in flight when the drain starts
        _set_policy(srv, queue_per_replica=10**6, down_delay_s=3600.0)  # nothing grows nor shrinks by itself
        leaving = srv.state.clients[1]
        on_leaving: list[int] = []

        async def drain_under_streams() -> tuple[list[Stream], list[Stream]]:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            first: list[asyncio.Future] = []
            while leaving.load == 0:  # the router balances: one of the first few lands on the second replica
                assert len(first) < 64, "no stream reached the second replica"
                first.append(asyncio.ensure_future(_stream(client, len(first) % len(PROMPTS), 48)))
                await asyncio.sleep(0.02)
            asyncio.run_coroutine_threadsafe(srv.autoscaler.drain_last(), srv.autoscaler.loop).result(timeout=30)
            on_leaving.append(leaving.load)
            # sent while it drains: routed to the replica that stays
            later = [asyncio.ensure_future(_stream(client, i % len(PROMPTS), 8)) for i in range(4)]
            while not all(t.done() for t in first + later):
                on_leaving.append(leaving.load)
                await asyncio.sleep(0.01)
            await client.close()
            return [t.result() for t in first], [t.result() for t in later]

        first, later = asyncio.run(drain_under_streams())
        assert on_leaving[0] >= 1, "the drain began with no stream in flight on the leaving replica"
        assert all(b <= a for a, b in zip(on_leaving, on_leaving[1:])), on_leaving  # nothing new sent to it
        _assert_complete(before, 48)
        _assert_complete(first, 48)
        _assert_complete(later, 8)
        _assert_one_replica_left(srv)
    finally:
        _set_policy(srv, min_replicas=1, max_replicas=3, queue_per_replica=1, down_delay_s=1.0)


def test_a_replica_that_joins_takes_over_requests_waiting_on_the_busy_one_and_every_stream_completes(srv):
    import ray

    # the test adds the replica itself, once requests wait: nothing grows or shrinks by itself meanwhile
    _set_policy(srv, queue_per_replica=10**6, down_delay_s=3600.0)
    try:
        joining = srv.fleet.add()  # started and in the fleet, not yet routed to
        joining.result(timeout=180)
        busy, before = srv.state.clients[0], migrations_counted(srv.url, "rebalanced")
        issued = srv.state.uids.issued

        async def burst() -> tuple[list[Stream], int]:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            streams = [asyncio.ensure_future(_stream(client, i % len(PROMPTS), 48)) for i in range(16)]
            while srv.state.uids.issued - issued < len(streams):  # every request sent to the one replica routed to
                await asyncio.sleep(0.01)

            async def join() -> int:  # on the router's loop, where its clients change
                waiting = len(busy.waiting)  # two run at a time there (max_running_reqs), the rest wait
                await srv.autoscaler._install(joining)
                return waiting

            waiting = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(join(), srv.autoscaler.loop))
            done = list(await asyncio.gather(*streams))
            await client.close()
            return done, waiting

        streams, waiting = asyncio.run(burst())
        assert waiting > 0, "every request had its first token before the replica joined"
        moved = migrations_counted(srv.url, "rebalanced") - before
        # loads of 16 and 0 even out at 8 and 8, as far as requests still wait
        assert 1 <= moved <= min(waiting, 8), (moved, waiting)
        _assert_complete(streams, 48)  # a moved stream's text is the one the busy replica gives its prompt
        assert len(srv.state.clients) == 2
        for replica in srv.replicas:
            ray.get(replica.actor.check_integrity.remote())
    finally:
        _set_policy(srv, min_replicas=1, max_replicas=3, queue_per_replica=1, down_delay_s=1.0)
    _assert_one_replica_left(srv)


def test_a_replica_that_dies_during_its_own_start_is_started_again_until_the_fleet_has_the_count_wanted(srv):
    import ray

    failed = srv.autoscaler.failed_starts
    _set_policy(srv, min_replicas=2)  # one replica serves, two are wanted: one is started at once
    try:

        def starting() -> str | None:
            names = ray.util.list_named_actors()
            return next((n for n in names if n.startswith("raylm-replica-1-rank-0-")), None)

        _wait_for(lambda: starting() is not None, "the new replica's actor created")
        ray.kill(ray.get_actor(starting()), no_restart=True)
        _wait_for(lambda: len(srv.state.clients) == 2, "a second replica serving")
        assert srv.autoscaler.failed_starts == failed + 1  # the one killed was starting
        assert srv.autoscaler.wanted == 2 and len(srv.replicas) == 2
        _assert_complete(asyncio.run(_streams(srv, 4)))
    finally:
        _set_policy(srv, min_replicas=1)
    _assert_one_replica_left(srv)


def test_router_actors_route_to_a_replica_the_fleet_grew_by_and_drain_the_one_it_shrinks_by(qwen3_path):
    import ray

    from router.tier.directory import read_directory

    with serving(
        qwen3_path,
        routers=1,
        min_replicas=1,
        max_replicas=2,
        autoscale_queue_per_replica=1,
        autoscale_up_delay_s=0.0,
        autoscale_down_delay_s=1.0,
        max_running_reqs=2,
        num_pages=128,
    ) as tier_srv:
        tier_srv.autoscaler.interval_s = 0.2
        router = tier_srv.tier.actors[0]

        def routed() -> int:
            return ray.get(router.__ray_call__.remote(lambda self: len(self.state.clients)))

        streams = _feed_until(
            tier_srv, lambda: ray.get(router.replica_load.remote(1)) > 0, "the router sending replica 1 streams"
        )
        _assert_complete(streams)
        # the router actor served them all: an id for each, and one more for each it moved to the replica
        # that joined (waiting there, router/replicas/rebalance.py)
        moved = migrations_counted(tier_srv.url, "rebalanced")
        assert ray.get(router.admitted.remote()) == len(streams) + moved
        _assert_one_replica_left(tier_srv)
        _wait_for(lambda: routed() == 1, "the router left with one replica")
        assert len(read_directory(tier_srv.config.port)[2]) == 1  # a router restarting now starts on it
        _wait_for(
            lambda: _gauge(httpx.get(tier_srv.url + "/metrics", timeout=30).text, "raylm:replicas_wanted") == 1,
            "the router's /metrics showing one replica wanted",
            timeout_s=30,
        )
