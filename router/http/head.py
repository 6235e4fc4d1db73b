"""HEAD on every GET route, as HTTP asks of a server (RFC 9110, 9.3.2): the request runs as a GET and
its response goes out with the GET's headers and no body. FastAPI routes answer only the methods they
are declared with."""

from __future__ import annotations


class HeadAsGet:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
