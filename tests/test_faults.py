"""Faults while serving: a replica's scheduler actor or one of its followers dies mid-stream. With
migration off (max_migrations 0; test_migration_serving.py has it on), its requests end with a clear
error within 5 s, /health says so, the other replica keeps serving, and the
replica is replaced and takes traffic again."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import ray
from helpers import serving


@pytest.fixture(scope="module")
def tp2_pair(ray_cluster, qwen3_path):
    with serving(
        qwen3_path,
        replicas=2,
        tp_size=2,
        num_pages=1024,
        max_running_reqs=8,
        routing="round_robin",
        collective_timeout_s=10,
        max_migrations=0,
    ) as srv:
        yield srv


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stream_until_killed(srv, kill) -> tuple[list[dict], float]:
    """Starts a long stream, kills part of the replica serving it once tokens flow; returns the
    stream's events and the seconds from the kill to the stream's end."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True, "stream": True}
    events, killed_at = [], None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if killed_at is None and len(events) >= 3:
                serving = [i for i, c in enumerate(srv.state.clients) if c.load > 0]
                assert len(serving) == 1
                kill(srv.replicas[serving[0]])
                killed_at = time.monotonic()
    return events, time.monotonic() - killed_at


def check_recovers(srv, restarts_before: int) -> None:
    wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, 5, "/health to report the replica down")
    # the other replica keeps serving meanwhile
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 180, "the replica to be replaced")
    assert srv.supervisor.restarts == restarts_before + 1
    before = [ray.get(rep.actor.stats.remote()).decode_tokens for rep in srv.replicas]
    for _ in range(4):  # round-robin: both replicas get some
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200
    after = [ray.get(rep.actor.stats.remote()).decode_tokens for rep in srv.replicas]
    assert all(a > b for a, b in zip(after, before))


def test_killed_scheduler_actor_fails_its_stream_and_is_replaced(tp2_pair):
    restarts = tp2_pair.supervisor.restarts
    events, seconds = stream_until_killed(tp2_pair, lambda rep: ray.kill(rep.actor, no_restart=True))
    assert "error" in events[-1] and "replica" in events[-1]["error"]["message"]
    assert seconds < 5
    check_recovers(tp2_pair, restarts)


def test_killed_follower_fails_its_stream_and_is_replaced(tp2_pair):
    restarts = tp2_pair.supervisor.restarts
    events, seconds = stream_until_killed(tp2_pair, lambda rep: ray.kill(rep.followers[0], no_restart=True))
    assert "error" in events[-1] and "tensor-parallel group failed" in events[-1]["error"]["message"]
    assert seconds < 5
    check_recovers(tp2_pair, restarts)


def _raylm_objects() -> tuple[list[str], list[str]]:
    from conftest import live_ray_objects

    actors, groups = live_ray_objects()
    return (
        sorted(a for a in actors if a in ("SchedulerActor", "Follower")),
        sorted(g for g in groups if g.startswith("raylm-")),
    )


def test_a_replica_paused_shorter_than_the_health_timeout_keeps_serving(ray_cluster, qwen3_path):
    """A busy host can keep a replica from answering for seconds; that alone must not replace it."""
    with serving(qwen3_path, replicas=1, tp_size=1, num_pages=256, health_check_timeout_s=30) as srv:
        _, pid = ray.get(srv.replicas[0].actor.node_and_pid.remote())
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3)  # the state under test is "silent for a while", not a synchronisation
        finally:
            os.kill(pid, signal.SIGCONT)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        assert srv.supervisor.restarts == 0 and httpx.get(srv.url + "/health").status_code == 200


def test_a_silent_replica_is_replaced_and_stopping_mid_replacement_leaves_nothing(ray_cluster, qwen3_path):
    before = _raylm_objects()  # the module's other server is still up
    with serving(qwen3_path, replicas=1, tp_size=1, num_pages=256, health_check_timeout_s=2) as srv:
        _, pid = ray.get(srv.replicas[0].actor.node_and_pid.remote())
        os.kill(pid, signal.SIGSTOP)  # alive but answering nothing: a hung replica
        try:
            wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, 30, "the replica to be marked down")
            body = httpx.get(srv.url + "/health").json()
            assert "has not answered a health check in 2 s" in json.dumps(body)
        finally:
            os.kill(pid, signal.SIGCONT)
        # the server stops while the replacement is being built
    # the control store sees killed actors as dead a moment after the kill: a bounded wait
    wait_for(lambda: _raylm_objects() == before, 30, "the replacement's actors and placement group to go")


def test_health_fails_within_the_health_timeout_when_rays_control_store_is_gone(qwen3_path, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import psutil
    from helpers import free_port

    port, timeout_s = free_port(), 3
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            str(root / "launch.py"),
            "--model",
            str(qwen3_path),
            "--port",
            str(port),
            "--page-size",
            "4",
            "--num-pages",
            "256",
            "--no-dashboard",
            "--health-check-timeout-s",
            str(timeout_s),
        ],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/health"
    try:
        wait_for(lambda: proc.poll() is None and _status(url) == 200, 120, "the server to come up")
        gcs = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("gcs_server")]
        assert len(gcs) == 1, "the local Ray's control store"
        gcs[0].kill()
        gone = time.monotonic()
        wait_for(lambda: _status(url) != 200, timeout_s + 10, "/health to fail")
        # failing within the timeout (plus one probe and one supervisor round), long before the driver exits
        assert time.monotonic() - gone < timeout_s + 6
        r = httpx.get(url, timeout=5)
        assert r.status_code == 503 and "control store" in r.json()["cluster"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None
