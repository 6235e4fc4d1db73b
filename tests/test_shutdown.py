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
from conftest import live_ray_objects

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_drains_in_flight_requests_then_leaves_nothing_behind(ray_cluster, qwen3_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = ray_cluster.get_runtime_context().gcs_address
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--model", str(qwen3_path), "--port", str(port),
                             "--address", address, "--replicas", "2", "--page-size", "4", "--num-pages", "1024",
                             "--drain-timeout-s", "30", "--served-model-name", "tiny"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True,
                    "stream": True}
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
                refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                                     timeout=5).status_code == 503
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
