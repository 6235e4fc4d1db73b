"""uvicorn as a router serves: new requests get a 503 once shutdown begins, and those still running
near the drain timeout end in order instead of being cut mid-response."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

from router.http.state import RouterState

log = logging.getLogger(__name__)


# after a second Ctrl-C, how long the requests failed in order have to send their error before the server stops
FORCED_GRACE_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn, draining as the router needs: once shutdown begins, new requests get a 503, and requests
    still running just before the drain timeout ends are failed in order (a stream gets an SSE error
    event and [DONE], a whole response a 503), instead of being cancelled mid-response by uvicorn."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: RouterState,
        drain_timeout_s: float,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s, self.on_ready = state, drain_timeout_s, on_ready
        self._forcing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # once it serves

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame) -> None:
        """A second Ctrl-C stops waiting for requests: uvicorn would cancel them mid-response, so they are
        failed in order first (as at the drain timeout), and the server stops FORCED_GRACE_S later."""
        super().handle_exit(sig, frame)
        if self.force_exit:
            self.force_exit = False
            self.stop_now()

    def stop_now(self) -> None:
        """Fails the requests still running, in order, and stops the server FORCED_GRACE_S later; from any
        thread. Once."""
        if self._forcing or self._loop is None:
            return
        self._forcing = True
        self._loop.call_soon_threadsafe(self._force)

    def _force(self) -> None:
        # draining first: replicas failed by the cut are then not replaced (the supervisor skips a draining server)
        self.state.draining = True
        self._cut("it was told to stop at once (a second Ctrl-C)")
        self._loop.call_later(FORCED_GRACE_S, setattr, self, "force_exit", True)

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        running = sum(c.load for c in self.state.clients)
        log.warning(
            "draining: no new requests; %d in flight may take up to %g s to finish", running, self.drain_timeout_s
        )
        # uvicorn cancels what still runs at the timeout: end it a little before, so each response is whole
        cut_after = max(0.0, self.drain_timeout_s - min(1.0, self.drain_timeout_s / 4))
        timer = asyncio.get_running_loop().call_later(cut_after, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut(self, why: str | None = None) -> None:
        why = why or f"its drain timeout of {self.drain_timeout_s:g} s ran out"
        running = sum(c.load for c in self.state.clients)
        if running:
            log.warning("%s: failing %d request(s) still running", why, running)
        for client in self.state.clients:
            client.mark_failed(f"the server is shutting down: {why}")
