"""What clients met at the edges of the API, each as the client sends it: any 64-bit seed; stream_options
only with a stream; prefix-cache hits in usage; the Authorization scheme in any case; HEAD on GET
routes; JSON errors for what the HTTP parser rejects; a body that stops arriving; an unreachable
--address; and successes counted apart from refusals, timeouts and aborts."""

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
import openai
import pytest
from fixtures import PROMPT_TEXTS
from helpers import free_port, serving

from router.http.metrics import RouterMetrics
from router.replicas.generation import Timing

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-edges"
BODY_TIMEOUT_S = 1.0
PAGE_SIZE = 4
C, CHAT = "/v1/completions", "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(
        qwen3_path,
        num_pages=512,
        max_running_reqs=8,
        api_key=KEY,
        body_timeout_s=BODY_TIMEOUT_S,
        page_size=PAGE_SIZE,
    ) as server:
        yield server


def api(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def sampled(srv, seed: int) -> str:
    r = api(srv).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[1], max_tokens=8, temperature=1, seed=seed, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def test_any_64_bit_seed_is_taken_and_mapped_modulo_2_63(srv):
    assert sampled(srv, -1) == sampled(srv, 2**63 - 1)
    assert sampled(srv, -(2**63)) == sampled(srv, 0) == sampled(srv, 2**63)
    assert sampled(srv, 2**64 - 1) == sampled(srv, -1)


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("stream", [False, None], ids=["stream-false", "no-stream"])
def test_stream_options_without_a_stream_is_a_400_naming_it(srv, path, stream):
    body = {**OK, "stream_options": {"include_usage": True}}
    if path == CHAT:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **body}
        body.pop("prompt")
    if stream is not None:
        body["stream"] = stream
    r = httpx.post(srv.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options" and "stream_options" in err["message"]


def test_cached_tokens_report_the_prompts_prefix_cache_hits(srv):
    prompt = PROMPT_TEXTS[11]  # a long prompt no other test of this module sends
    args = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    first = api(srv).completions.create(**args).usage
    again = api(srv).completions.create(**args).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    hit = again.prompt_tokens_details.cached_tokens
    # whole pages of the prompt, at least one token left to compute
    assert 0 < hit < again.prompt_tokens and hit % PAGE_SIZE == 0
    assert hit == (again.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE
    chunks = api(srv).completions.create(**args, stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == hit


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_the_authorization_scheme_is_case_insensitive(srv, scheme):
    r = httpx.post(srv.url + C, json=OK, headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["Basic " + KEY, "Bearer " + KEY.upper(), KEY, "Bearer"])
def test_another_scheme_or_key_is_a_401(srv, value):
    r = httpx.post(srv.url + C, json=OK, headers={"Authorization": value}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/health", "/version", "/v1/models", "/v1/models/tiny", "/metrics"])
def test_head_answers_every_get_route_with_its_headers_and_no_body(srv, path):
    got = httpx.get(srv.url + path, headers=AUTH, timeout=30)
    head = httpx.head(srv.url + path, headers=AUTH, timeout=30)
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # its counts may change between the two
        assert head.headers["content-length"] == got.headers["content-length"]


def test_head_on_a_post_route_is_a_405(srv):
    assert httpx.head(srv.url + C, headers=AUTH, timeout=30).status_code == 405


def _raw(srv, data: bytes, wait_s: float = 30) -> tuple[bytes, float]:
    """What the server answers to bytes sent on a connection of their own, read until it closes, and
    how long that took."""
    port = int(srv.url.rsplit(":", 1)[1])
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


def _status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.mark.parametrize(
    "request_bytes",
    [b"NOT AN HTTP REQUEST\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"],
    ids=["request-line", "header"],
)
def test_what_the_http_parser_rejects_gets_an_openai_error_body(srv, request_bytes):
    status, body = _status_and_json(_raw(srv, request_bytes)[0])
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


@pytest.mark.parametrize("body", [b'{"model": "tiny", "prompt": ', b"hello", b'{"model": oops}'])
def test_malformed_json_gets_an_openai_error_body_naming_no_field(srv, body):
    r = httpx.post(srv.url + C, content=body, headers={**AUTH, "content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and "not valid JSON" in error["message"] and error["param"] is None, error


def test_a_body_that_stops_arriving_is_cut_off_with_a_408(srv):
    head = (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
    ).encode()
    answer, took = _raw(srv, head + b'{"model": ')  # 10 bytes of the million declared, then nothing
    status, body = _status_and_json(answer)
    assert status == 408 and body["error"]["type"] == "timeout_error"
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 10  # and the connection was closed
    r = httpx.post(srv.url + C, json=OK, headers=AUTH, timeout=30)
    assert r.status_code == 200  # the server goes on serving


def _launch(qwen3_path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--model", str(qwen3_path), "--address", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_an_unreachable_address_fails_within_seconds_with_one_line(qwen3_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = _launch(qwen3_path, address)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - started < 30
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no Ray cluster answers" in lines[0] and address in lines[0], err


def test_ctrl_c_stops_the_launch_while_it_waits_on_the_address(qwen3_path):
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("0.0.0.0", 0))  # Ray reads 127.0.0.1 as this node's address, where its GCS listens
        silent.listen()
        connected = threading.Event()
        held = []
        proc = None

        def accept():
            held.append(silent.accept()[0])
            # Ctrl-C at once, from this thread: the probe gives up after 3 s, and on a busy host the
            # main thread could wake up later than that
            proc.send_signal(signal.SIGINT)
            connected.set()

        proc = _launch(qwen3_path, f"127.0.0.1:{silent.getsockname()[1]}")
        threading.Thread(target=accept, daemon=True).start()
        try:
            assert connected.wait(60), "the launch never probed the address"
            _, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            for conn in held:
                conn.close()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


def test_only_requests_that_ran_to_their_end_count_as_successes():
    metrics = RouterMetrics("m")
    for reason in ("stop", "length", "length", "timeout", "abort", "error"):
        metrics.finished(reason, 3, Timing())
    metrics.ended("rejected")
    text = metrics.exposition().decode()
    successes = {line for line in text.splitlines() if line.startswith("raylm:request_success_total{")}
    assert successes == {
        'raylm:request_success_total{finish_reason="stop",model="m"} 1.0',
        'raylm:request_success_total{finish_reason="length",model="m"} 2.0',
    }
    for reason in ("timeout", "abort", "error", "rejected"):
        assert f'raylm:request_failure_total{{model="m",reason="{reason}"}} 1.0' in text


def test_a_client_that_leaves_is_counted_as_an_abort_not_a_success(srv):
    def count(text: str, name: str, label: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith(name + "{") and label in x), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before = httpx.get(srv.url + "/metrics").text
    body = {**OK, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + C, json=body, headers=AUTH, timeout=30) as r:
        next(r.iter_lines())  # it runs; the client leaves
    deadline = time.monotonic() + 30
    while True:
        after = httpx.get(srv.url + "/metrics").text
        aborts = count(after, "raylm:request_failure_total", 'reason="abort"')
        if aborts > count(before, "raylm:request_failure_total", 'reason="abort"') or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # the router counts the abort once the disconnect has unwound the request
    assert aborts == count(before, "raylm:request_failure_total", 'reason="abort"') + 1
    assert 'finish_reason="abort"' not in after
