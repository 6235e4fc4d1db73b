"""A request-body size limit enforced on the bytes received, so a body without (or lying in) its
Content-Length cannot exceed it either. Bodies are read before the app sees them (they are small)."""

from __future__ import annotations

import json


class BodySizeLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"error": {"message": f"the request body is over {self.max_bytes} bytes",
                                     "type": "invalid_request_error", "param": None, "code": None}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
