"""What every request passes before the API sees it, as plain ASGI (no per-request task, safe with
streaming and disconnects): the API key on /v1 routes (constant-time compare; the scheme's name in any
case, as RFC 7235 has it), the body-size limit on the bytes actually received (a body without or lying
in its Content-Length included), the body timeout (a body that stops arriving), and refusal of new work
while draining."""

from __future__ import annotations

import asyncio
import hmac
import time

from router.http.errors import anthropic_route, responder

# the scope's key for when the request was received (time.perf_counter): where its TTFT starts
RECEIVED = "raylm.received"
# what the API key protects: everything but the probes (/health, /metrics, /version)
_GUARDED = ("/v1", "/tokenize", "/detokenize")


class RequestGuard:
    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED] = time.perf_counter()
        cfg = self.state.config
        # Anthropic's clients send the key in x-api-key, and read errors in Anthropic's shape
        anthropic = anthropic_route(scope["path"])
        respond = responder(scope["path"])
        if scope["path"].startswith(_GUARDED):
            if cfg.api_key is not None:
                headers = dict(scope["headers"])
                scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
                # compared whatever the scheme, so that the time taken says nothing of the key
                ok = hmac.compare_digest(given.strip(), cfg.api_key.encode()) and scheme.lower() == b"bearer"
                if anthropic and not ok:
                    ok = hmac.compare_digest(headers.get(b"x-api-key", b""), cfg.api_key.encode())
                if not ok:
                    return await respond(
                        401,
                        "invalid or missing API key (send Authorization: Bearer KEY"
                        + (", or x-api-key: KEY)" if anthropic else ")"),
                        "authentication_error",
                        code="invalid_api_key",
                    )(scope, receive, send)
            if self.state.draining and scope["method"] == "POST":
                return await respond(503, "the server is shutting down", "service_unavailable")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:  # one timer for the whole body (a task per chunk would cost every request)
            async with asyncio.timeout(cfg.body_timeout_s):
                chunks = await _read_body(receive, cfg.max_body_bytes)
        except TimeoutError:
            too_slow = respond(408, f"the request body did not arrive within {cfg.body_timeout_s} s", "timeout_error")
            too_slow.headers["connection"] = "close"  # the rest of the body would be read as a request
            return await too_slow(scope, receive, send)
        if chunks is None:
            return  # the client left before sending it all
        if sum(map(len, chunks)) > cfg.max_body_bytes:
            return await respond(413, f"the request body is over {cfg.max_body_bytes} bytes")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect

        await self.app(scope, replay, send)


async def _read_body(receive, limit: int) -> list[bytes] | None:
    """The body's chunks, read until it ends or just past `limit` bytes (bodies are small: read whole,
    refused as soon as they are too big); None when the client left before sending it all."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit or not message.get("more_body", False):
            return chunks
