"""The router tier on real Ray: `routers` RouterActors, named in Ray, sharing one port (SO_REUSEPORT),
each answering what the offline engine answers, /metrics the tier's sums, a router's failed client of
a serving replica repaired; one killed under load is restarted by Ray while the
other serves, its streams end with the connection, and its replica aborts them (no request keeps
generating for a client that is gone), pages all returned; a restarted router starts on the replicas
serving now, from the tier's directory (which, restarted by Ray, is published to again), and nothing
of its arguments is kept in Ray's object store."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from helpers import serving

from cluster import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("ray_cluster")

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(6 + i % 5)] for i in range(12)]


def _texts(url: str, ids: list[int], n: int) -> str:
    with httpx.Client(timeout=60) as http:  # a fresh connection: the kernel picks a router for each
        r = http.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True},
        )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_router_actors_share_the_port_and_answer_as_the_offline_engine(qwen3_path):
    import ray

    with serving(qwen3_path, routers=2, num_pages=256, max_running_reqs=8) as srv:
        for k in range(2):  # named in Ray (and its dashboard)
            assert ray.get(ray.get_actor(f"raylm-router-{srv.config.port}-{k}").ping.remote())[0] > 0
        got = [_texts(srv.url, ids, 8) for ids in PROMPTS * 2]
        admitted = ray.get([a.admitted.remote() for a in srv.tier.actors])
        assert sum(admitted) == 2 * len(PROMPTS) and min(admitted) > 0, admitted  # both routers served
        for _ in range(4):  # whichever router a scrape reaches shows the tier's counts
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            line = next(x for x in text.splitlines() if x.startswith("raylm:request_success_total{"))
            assert float(line.split()[-1]) == 2 * len(PROMPTS), line
            assert "raylm:num_requests_running" in text
        # a router whose client of a serving replica failed (a transient error) is given it back
        router = srv.tier.actors[0]
        ray.get(
            router.__ray_call__.remote(
                lambda self: (
                    self._loop.call_soon_threadsafe(self.state.clients[0].mark_failed, "injected: a poll failed")
                    and None
                )
            )
        )
        deadline = time.monotonic() + 30
        while ray.get(router.down_replicas.remote()) != []:
            assert time.monotonic() < deadline, "router 0 did not get replica 0 back"
            time.sleep(0.1)
        # the supervisor's verdict on a replica reaches every router at once: a stream there fails then
        # (one replica: nowhere to move it), not once the router's own channel has been silent for long
        verdict = "injected: replica 0 has not answered a health check"
        rest = _stream_then(srv.url, lambda: srv.tier.failed(0, srv.replicas[0].actor, verdict))
        assert any(verdict in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
        while any(ray.get(a.down_replicas.remote()) for a in srv.tier.actors):  # the tier's watch gives it back
            assert time.monotonic() < deadline, "the routers did not get replica 0 back"
            time.sleep(0.1)
        for replica in srv.replicas:
            ray.get(replica.actor.check_integrity.remote())
            # the routers (subscribers 1 and 2) get the cache's contents, router 0 again once its client
            # is back and has asked for them; the launching process, which routes nothing beside them, does not
            while (
                receivers := ray.get(replica.actor.__ray_call__.remote(lambda self: self.subscribers.kv_receivers()))
            ) != [1, 2]:
                assert time.monotonic() < deadline, receivers
                time.sleep(0.1)
    with LLM(str(qwen3_path), page_size=4) as llm:  # after the server: the two would share this machine's cores
        want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    assert got == want * 2


def _stream_then(url: str, act) -> list[str]:
    """The lines of a long stream after its first token, `act` called once that token has arrived."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines).startswith("data: {")
        act()
        return list(lines)


async def _stream(url: str, ids: list[int], n: int) -> str:
    """'done' when the stream ends with [DONE], 'cut' when its connection closes first."""
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream(
                "POST",
                url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": ids,
                    "max_tokens": n,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        return "done"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut"
    return "cut"


def test_a_router_killed_is_restarted_on_the_replicas_serving_now_and_its_requests_are_aborted(qwen3_path, capfd):
    import ray

    with serving(qwen3_path, routers=2, num_pages=1024, max_running_reqs=16) as srv:
        # Ray warns at launch when a restartable actor's arguments sit in its object store (a restart
        # fails once they are lost there): a router's are two plain numbers
        assert "constructor arguments in the object store" not in capfd.readouterr().err
        victim = srv.tier.actors[0]
        first_start = ray.get(victim.ping.remote())

        async def load_then_kill() -> list[str]:
            # each stream is a new connection, which the kernel hashes to one router: a dozen may all land
            # on router 1, so streams are added until one is on the victim (96 on one router: a bug)
            streams = [asyncio.create_task(_stream(srv.url, ids, 400)) for ids in PROMPTS]
            deadline = time.monotonic() + 60
            while ray.get(victim.in_flight.remote()) == 0:
                assert time.monotonic() < deadline and len(streams) < 96, f"none of {len(streams)} streams on router 0"
                streams.append(asyncio.create_task(_stream(srv.url, PROMPTS[len(streams) % len(PROMPTS)], 400)))
                await asyncio.sleep(0.05)
            ray.kill(victim, no_restart=False)  # as a crash: Ray restarts it
            return await asyncio.gather(*streams)

        outcomes = asyncio.run(load_then_kill())
        assert "cut" in outcomes and "done" in outcomes, outcomes  # the other router's streams finished
        # Ray restarts the victim; its successor releases what it had sent: nothing keeps generating
        deadline = time.monotonic() + 90
        while True:
            try:
                if ray.get(victim.ping.remote(), timeout=10) != first_start:
                    break
            except Exception:  # noqa: BLE001 - restarting
                pass
            assert time.monotonic() < deadline, "router 0 was not restarted"
            time.sleep(0.2)
        replica = srv.replicas[0].actor
        while ray.get(replica.stats.remote()).running:
            assert time.monotonic() < deadline, "the killed router's requests still run on the replica"
            time.sleep(0.1)
        ray.get(replica.check_integrity.remote())
        assert all(_texts(srv.url, ids, 4) for ids in PROMPTS[:6])  # both routers serve again
        # a router Ray will not restart (killed for good, or its restart failed) is made anew by the tier
        ray.kill(srv.tier.actors[1], no_restart=True)
        while srv.tier.recreated == 0:
            assert time.monotonic() < deadline + 60, "the tier did not replace router 1"
            time.sleep(0.1)
        new = srv.tier.actors[1]
        assert ray.get(new.ping.remote(), timeout=60)[0] > 0
        assert ray.get(ray.get_actor(f"raylm-router-{srv.config.port}-1").ping.remote()) == ray.get(new.ping.remote())
        assert all(_texts(srv.url, ids, 4) for ids in PROMPTS[:6])
        # a router restarted after a replica was replaced starts on the replacement, from the tier's
        # directory: nothing tells it afterwards
        gone = srv.replicas[0].actor
        ray.kill(gone, no_restart=True)
        while srv.supervisor.restarts == 0:
            assert time.monotonic() < deadline + 120, "replica 0 was not replaced"
            time.sleep(0.1)
        second_start = ray.get(victim.ping.remote())
        ray.kill(victim, no_restart=False)
        while True:
            try:
                if ray.get(victim.ping.remote(), timeout=10) != second_start:
                    break
            except Exception:  # noqa: BLE001 - restarting
                pass
            assert time.monotonic() < deadline + 180, "router 0 was not restarted again"
            time.sleep(0.2)
        routed = ray.get(victim.__ray_call__.remote(lambda self: [c.actor._actor_id for c in self.state.clients]))
        assert routed == [srv.replicas[0].actor._actor_id] != [gone._actor_id]
        assert all(_texts(srv.url, ids, 4) for ids in PROMPTS[:6])
        # the directory, restarted by Ray (empty), is published to again
        directory = ray.get_actor(f"raylm-tier-{srv.config.port}")
        ray.kill(directory, no_restart=False)
        while True:
            try:
                if ray.get(directory.spec.remote(), timeout=10)[2] == srv.tier.replicas:
                    break
            except Exception:  # noqa: BLE001 - restarting, or not yet published
                pass
            assert time.monotonic() < deadline + 240, "the tier's directory was not published again"
            time.sleep(0.1)
        assert "constructor arguments in the object store" not in capfd.readouterr().err
