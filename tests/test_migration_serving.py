"""Mid-stream migration on real Ray through the HTTP API: with 32 seeded sampled and greedy streams in
flight over two replicas, a replica's scheduler actor killed, or the replica drained, leaves every
stream whole: no error, and exactly the tokens of an undisturbed run. A drain cuts nothing, not even a
stream that may not move again; a stream whose replica dies more often than max_migrations allows
ends with a clear error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from fixtures import PROMPT_TEXTS
from helpers import migrations_counted, serving

STREAMS, MAX_TOKENS, KILL_AFTER = 32, 48, 4


@pytest.fixture(scope="module")
def pair(ray_cluster, qwen3_path):
    with serving(
        qwen3_path,
        replicas=2,
        num_pages=2048,
        max_running_reqs=STREAMS,
        routing="round_robin",
        max_migrations=1,
    ) as srv:
        yield srv


@dataclass
class Stream:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None


def _body(i: int) -> dict:
    """Stream i: every other one greedy, the others sampled with their own seed (some with penalties)."""
    body = {
        "model": "tiny",
        "prompt": PROMPT_TEXTS[i % len(PROMPT_TEXTS)],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if i % 2:
        body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        if i % 4 == 3:
            body.update(presence_penalty=0.5, frequency_penalty=0.7)
    else:
        body["temperature"] = 0
    return body


async def _stream(http: httpx.AsyncClient, body: dict, reached: Callable[[int], Awaitable[None]]) -> Stream:
    out = Stream()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            choice = event["choices"][0]
            out.token_ids += choice.get("token_ids") or []
            out.text += choice["text"]
            out.finish_reason = choice["finish_reason"] or out.finish_reason
            await reached(len(out.token_ids))
    return out


def run_streams(srv, bodies: list[dict], at_k: Callable[[], object] | None = None) -> tuple[list[Stream], object]:
    """Runs every stream at once; once each has received KILL_AFTER tokens, `at_k()` runs (on a thread)
    while they go on. Returns the streams and what `at_k` returned."""

    async def main() -> tuple[list[Stream], object]:
        everyone_there, short = asyncio.Event(), {"of": len(bodies)}

        def counter() -> Callable[[int], Awaitable[None]]:
            there = False

            async def reached(n: int) -> None:
                nonlocal there
                if n >= KILL_AFTER and not there:
                    there, short["of"] = True, short["of"] - 1
                    if not short["of"]:
                        everyone_there.set()

            return reached

        async def fire() -> object:
            await everyone_there.wait()
            return await asyncio.to_thread(at_k)

        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            firing = asyncio.ensure_future(fire()) if at_k is not None else None
            streams = await asyncio.gather(*(_stream(http, body, counter()) for body in bodies))
            if firing is None:
                return streams, None
            if not everyone_there.is_set():
                firing.cancel()
                pytest.fail("a stream ended before every stream had its first tokens")
            return streams, await firing

    return asyncio.run(main())


def _migrations(srv, cause: str) -> float:
    return migrations_counted(srv.url, cause)


def _wait_until_healthy(srv) -> None:
    deadline = time.monotonic() + 180
    while httpx.get(srv.url + "/health").status_code != 200 or not all(c.healthy for c in srv.state.clients):
        assert time.monotonic() < deadline, "the fleet did not recover"
        time.sleep(0.2)


def _check_whole(got: list[Stream], want: list[Stream]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.error is None, (i, g.error)
        assert g.token_ids == w.token_ids, f"stream {i}"
        assert g.text == w.text and g.finish_reason == w.finish_reason == "length"


@pytest.fixture(scope="module")
def undisturbed(pair) -> list[Stream]:
    streams, _ = run_streams(pair, [_body(i) for i in range(STREAMS)])
    assert all(s.error is None and len(s.token_ids) == MAX_TOKENS for s in streams)
    return streams


def test_every_stream_of_a_killed_replica_completes_with_the_tokens_of_an_undisturbed_run(pair, undisturbed):
    def kill() -> int:
        live = pair.state.clients[0].load  # its streams in flight, as the router sees them
        ray.kill(pair.replicas[0].actor, no_restart=True)
        return live

    # as with a drain, on a loaded host the replica may have generated every token before the kill (the
    # rest waiting in the sockets, the router's load still counting them): a kill with nothing left to
    # move tests nothing, so the run is made again
    for _ in range(3):
        _wait_until_healthy(pair)
        before = _migrations(pair, "replica_down")
        streams, live = run_streams(pair, [_body(i) for i in range(STREAMS)], kill)
        _check_whole(streams, undisturbed)
        moved = _migrations(pair, "replica_down") - before
        assert moved <= live
        if moved > 0:
            break
    assert moved > 0, "every stream of the killed replica had ended before the kill, three times"
    for replica in pair.replicas[1:]:
        ray.get(replica.actor.check_integrity.remote())
    _wait_until_healthy(pair)


def test_a_drain_with_streams_in_flight_moves_them_and_cuts_nothing(pair, undisturbed):
    _wait_until_healthy(pair)
    # the drain comes once every client has read a few tokens; on a loaded host the replicas may have
    # generated every token by then (the rest waiting in the sockets): a drain with nothing left to move
    # tests nothing, so the run is made again
    for _ in range(3):
        before = _migrations(pair, "drained")
        try:
            streams, had = run_streams(pair, [_body(i) for i in range(STREAMS)], lambda: pair.drain_replica(1))
            assert pair.state.clients[1].load == 0  # nothing of this router is left on the drained replica
        finally:
            pair.undrain_replica(1)
        assert pair.state.routable == pair.state.clients  # routed to again
        _check_whole(streams, undisturbed)
        assert _migrations(pair, "drained") - before == had  # each stream it had moved
        if had > 0:
            break
    assert had > 0, "every stream had ended before the drain, three times"
    for replica in pair.replicas:
        ray.get(replica.actor.check_integrity.remote())


def test_health_names_the_drained_replicas_and_fails_once_none_takes_requests(pair):
    _wait_until_healthy(pair)
    try:
        assert pair.drain_replica(1) == 0
        r = httpx.get(pair.url + "/health")
        assert r.status_code == 200 and r.json()["replicas_drained"] == [1]  # replica 0 serves
        pair.drain_replica(0)
        r = httpx.get(pair.url + "/health")  # a load balancer must stop sending here
        assert r.status_code == 503 and r.json()["replicas_drained"] == [0, 1], r.text
    finally:
        pair.undrain_replica(0)
        pair.undrain_replica(1)
    r = httpx.get(pair.url + "/health")
    assert r.status_code == 200 and "replicas_drained" not in r.json()


def test_a_drain_leaves_a_stream_that_may_not_move_again_to_finish_where_it_is(pair, undisturbed):
    _wait_until_healthy(pair)
    before = _migrations(pair, "drained")
    drained: list[int] = []

    async def main() -> Stream:
        drains = []

        async def reached(n: int) -> None:
            serving = [i for i, c in enumerate(pair.state.clients) if c.load > 0 and i not in drained]
            # first after a few tokens (it moves), then once it is on the other replica (it may not again)
            if serving and (drained or n >= KILL_AFTER) and len(drained) < 2:
                drained.append(serving[0])
                drains.append(asyncio.ensure_future(asyncio.to_thread(pair.drain_replica, serving[0])))

        async with httpx.AsyncClient(base_url=pair.url, timeout=120) as http:
            stream = await _stream(http, _body(1), reached)
        assert await asyncio.gather(*drains) == [1, 1]  # the second returned once the stream had ended
        return stream

    try:
        stream = asyncio.run(main())
    finally:
        for client in pair.state.clients:
            client.undrain()
    assert len(drained) == 2
    _check_whole([stream], undisturbed[1:2])
    assert _migrations(pair, "drained") - before == 1


def test_a_stream_whose_replicas_go_away_more_often_than_the_limit_ends_with_a_clear_error(pair):
    _wait_until_healthy(pair)
    killed: list[int] = []

    async def main() -> Stream:
        async def reached(n: int) -> None:
            serving = [i for i, c in enumerate(pair.state.clients) if c.load > 0 and i not in killed]
            # first after a few tokens, then as soon as its continuation is on the other replica
            if serving and (killed or n >= KILL_AFTER) and len(killed) < 2:
                killed.append(serving[0])
                await asyncio.to_thread(ray.kill, pair.replicas[serving[0]].actor, no_restart=True)

        body = dict(_body(0), max_tokens=400)
        async with httpx.AsyncClient(base_url=pair.url, timeout=120) as http:
            return await _stream(http, body, reached)

    stream = asyncio.run(main())
    assert len(killed) == 2 and stream.error is not None, stream
    assert "max_migrations" in stream.error["message"] and stream.finish_reason is None
    assert KILL_AFTER <= len(stream.token_ids) < 400
    _wait_until_healthy(pair)
