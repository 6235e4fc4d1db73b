"""Connections themselves are bounded: slow or silent clients are disconnected after the header
timeout, good requests are served while many of them are held, and connections beyond the limit are
refused with a 503."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
from helpers import serving

from router.http import connection

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 350  # above the 300 slow and silent ones held below; both ends stay well under 1024 files
OK = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(
        qwen3_path, num_pages=256, header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS
    ) as server:
        yield server


def test_httptools_is_the_protocol_when_installed():
    made = connection.bounded_protocol(1.0, 1)
    assert made.func is (
        connection.BoundedH11Protocol if connection.HttpToolsProtocol is None else connection.BoundedHttpToolsProtocol
    )


@pytest.mark.parametrize("impl", ["h11", "httptools"])
def test_both_protocols_bound_silent_clients_and_the_connection_count(impl):
    """The bounds on each protocol (the server above runs the default one), over a bare ASGI app."""
    import threading

    import uvicorn

    if impl == "httptools" and connection.HttpToolsProtocol is None:
        pytest.skip("httptools is not installed")

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    from helpers import free_port

    port, timeout_s = free_port(), 1.0
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=30,
            http=connection.bounded_protocol(timeout_s, 3, impl=impl),
        )
    )
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    target = SimpleNamespace(config=SimpleNamespace(port=port))
    try:
        silent = _connect(target)
        kept = _connect(target, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(kept).startswith(b"HTTP/1.1 200")
        extra = [_connect(target) for _ in range(2)]  # the third and fourth: one past the limit of 3
        extra[-1].settimeout(10)
        assert extra[-1].recv(4096).startswith(b"HTTP/1.1 503")
        assert _closed_by_server(silent, timeout_s + 5)  # no headers within the header timeout
        time.sleep(timeout_s)  # kept idle past the header timeout: the state under test
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # idle past it between requests, still served
        assert _response(kept).startswith(b"HTTP/1.1 200")
        for sock in [silent, kept] + extra:
            sock.close()
    finally:
        server.should_exit = True
        thread.join(10)


def _connect(srv, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.config.port), timeout=30)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while sock.recv(4096):  # a refusal may come first; then the close (b"")
            if time.monotonic() > deadline:
                return False
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_good_requests_are_served_while_many_slow_header_connections_are_held(srv):
    slow = [_connect(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(150)]
    idle = [_connect(srv) for _ in range(150)]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for _ in range(5):
                r = http.post("/v1/completions", json=OK)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # the slow and the silent are cut off once their headers are overdue
        deadline = HEADER_TIMEOUT_S + 10
        assert all(_closed_by_server(s, deadline) for s in slow[:10] + idle[:10])
    finally:
        for s in slow + idle:
            s.close()


def test_a_client_that_trickles_its_headers_is_cut_off_at_the_header_timeout(srv):
    sock = _connect(srv, b"POST /v1/completions HTTP/1.1\r\n")
    started = time.monotonic()
    try:
        for _ in range(int(HEADER_TIMEOUT_S * 4)):  # a header line each 0.5 s: never complete
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.5)  # the client's pace under test, not a synchronisation
        assert _closed_by_server(sock, HEADER_TIMEOUT_S + 10)
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 10
    finally:
        sock.close()


def test_an_idle_kept_alive_connection_is_bounded_by_the_keep_alive_timeout_not_the_header_timeout(srv):
    body = json.dumps(OK).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    sock = _connect(srv)
    try:
        for _ in range(2):
            sock.sendall(request)
            answer = b""
            while b'"usage"' not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer  # the server closed the connection
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(HEADER_TIMEOUT_S * 1.5)  # idle between requests: the state under test
    finally:
        sock.close()


def test_connections_beyond_the_limit_get_a_503_and_are_closed(srv):
    held = [_connect(srv) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = _connect(srv)
        extra.settimeout(10)
        answer = extra.recv(4096)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the held ones are gone: new connections are served again
        try:
            if httpx.post(srv.url + "/v1/completions", json=OK, timeout=30).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _response(sock) -> bytes:
    """One whole response of the bare app (its headers, then its 2-byte body, maybe in separate reads)."""
    sock.settimeout(10)
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        assert chunk, answer
        answer += chunk
    return answer


def _running(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("raylm:num_requests_running{")
    )


def test_a_stream_whose_client_leaves_before_its_body_starts_is_ended_and_aborted_once(srv, monkeypatch):
    import ray
    from uvicorn.protocols.http.h11_impl import H11Protocol

    bases = [H11Protocol] + ([connection.HttpToolsProtocol] if connection.HttpToolsProtocol is not None else [])

    def backed_up(received):
        def data_received(self, data: bytes) -> None:
            """The response's start waits on the connection's writes until the client has left and its
            leaving has cancelled the response: its body never starts."""
            received(self, data)
            if self.cycle is not None and not self.cycle.response_started:
                self.flow.pause_writing()
                self.flow.resume_writing = lambda: None

        return data_received

    for base in bases:
        monkeypatch.setattr(base, "data_received", backed_up(base.data_received))
    body = json.dumps(
        {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    for _ in range(3):
        sock = _connect(srv, request)
        time.sleep(0.3)  # the response waits to start; then the client leaves
        sock.close()
    monkeypatch.undo()
    deadline = time.monotonic() + 20
    while (_running(srv), ray.get(srv.replicas[0].actor.stats.remote()).live) != (0, 0):
        assert time.monotonic() < deadline, "a request still counts as running, or still runs on the replica"
        time.sleep(0.1)
    r = httpx.post(srv.url + "/v1/completions", json=OK, timeout=30)  # and the server serves on
    assert r.status_code == 200 and _running(srv) == 0
