"""SIGTERM: new requests are refused, requests in flight finish (within the drain timeout), then the
process exits and leaves no actor or placement group in the cluster it joined."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import live_ray_objects

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_drains_in_flight_requests_then_leaves_nothing_behind(ray_cluster, qwen3_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = ray_cluster.get_runtime_context().gcs_address
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "--model",
            str(qwen3_path),
            "--port",
            str(port),
            "--address",
            address,
            "--replicas",
            "2",
            "--page-size",
            "4",
            "--num-pages",
            "1024",
            "--drain-timeout-s",
            "30",
            "--served-model-name",
            "tiny",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        streamed: list[dict] = []
        started = threading.Event()

        def long_stream() -> None:
            body = {
                "model": "tiny",
                "prompt": "Once upon a time",
                "max_tokens": 450,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[6:]))
                        started.set()
                    elif line == "data: [DONE]":
                        streamed.append({"done": True})

        client = threading.Thread(target=long_stream)
        client.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        refused, deadline = False, time.monotonic() + 10
        while not refused and time.monotonic() < deadline and not streamed[-1].get("done"):
            try:  # served until the signal lands, refused after
                refused = (
                    httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=5).status_code
                    == 503
                )
            except httpx.TransportError:
                refused = True
        client.join(60)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert refused
    assert streamed[-1] == {"done": True}
    assert streamed[-2]["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in out, out
    assert proc.returncode == 0, out  # a drained, orderly stop is a clean exit
    deadline = time.monotonic() + 30
    while live_ray_objects() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live_ray_objects() == ([], [])


def test_streams_still_running_when_the_drain_timeout_ends_get_an_error_event_and_done(ray_cluster, qwen3_path, caplog):
    import ray
    from helpers import serving

    with serving(qwen3_path, num_pages=1024, drain_timeout_s=2, health_check_timeout_s=60) as srv:
        _, pid = ray.get(srv.replicas[0].actor.node_and_pid.remote())
        endings: list[list[str]] = []
        started = threading.Barrier(4)

        def stream() -> None:
            body = {
                "model": "tiny",
                "prompt": "Once upon a time",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            lines: list[str] = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 2:
                            started.wait(30)
            endings.append(lines[-2:])

        clients = [threading.Thread(target=stream) for _ in range(3)]
        for c in clients:
            c.start()
        started.wait(30)  # every stream has its first tokens
        os.kill(pid, signal.SIGSTOP)  # the replica stops producing: these streams outlast any drain
        try:
            stopper = threading.Thread(target=srv.stop)
            stopper.start()
            for c in clients:
                c.join(30)
        finally:
            os.kill(pid, signal.SIGCONT)
        stopper.join(60)
    assert len(endings) == 3
    for error, done in endings:
        assert json.loads(error)["error"]["code"] == 503 and "drain timeout" in json.loads(error)["error"]["message"]
        assert done == "[DONE]"
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a cut request"


@pytest.mark.parametrize("routers", [0, 1])
def test_a_second_ctrl_c_fails_the_requests_still_running_in_order_and_stops_at_once(
    ray_cluster, qwen3_path, caplog, routers
):
    """The first Ctrl-C drains (here for up to 120 s); a second stops waiting: a whole request gets a 503 and a
    stream an error event and [DONE] (they were a 500 and a cut connection; with router actors, the full
    drain's wait), and the server stops in seconds."""
    import ray
    from helpers import serving

    config = {"num_pages": 1024, "drain_timeout_s": 120, "health_check_timeout_s": 120, "routers": routers}
    with serving(qwen3_path, **config) as srv:
        _, pid = ray.get(srv.replicas[0].actor.node_and_pid.remote())
        started = threading.Barrier(3)
        results: dict[str, object] = {}
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

        def stream() -> None:
            lines: list[str] = []
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 2:
                            started.wait(30)
            results["stream"] = lines[-2:]

        def whole() -> None:
            started.wait(30)  # sent once the stream runs: both are in flight when the replica stops
            results["whole"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for c in clients:
            c.start()
        started.wait(30)
        deadline = time.monotonic() + 30  # both reach the replica (through whichever router)
        while ray.get(srv.replicas[0].actor.stats.remote()).live < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)  # the replica stops producing: nothing ends by itself
        try:
            server = srv._uvicorn
            server.handle_exit(signal.SIGINT, None)  # the first: a drain of up to 120 s
            time.sleep(0.5)
            start = time.monotonic()
            server.handle_exit(signal.SIGINT, None)  # the second
            for c in clients:
                c.join(30)
            srv._thread.join(30)
            stopped = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
    assert stopped < 10, stopped
    error, done = results["stream"]
    assert json.loads(error)["error"]["code"] == 503 and "stop at once" in json.loads(error)["error"]["message"]
    assert done == "[DONE]"
    assert results["whole"].status_code == 503, results["whole"].text
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a request failed in order"
