"""A request of several prompts (a completion's list of prompts): one Generation per prompt, each
routed to its own replica, read as one stream of pieces, choice i of prompt p re-indexed p * n + i."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from router.replicas.generation import Generation, Piece


class MergedGenerations:
    """The pieces of every prompt's generation as they come; a failed one raises its error and the
    others are aborted. `aclose` aborts whatever has not ended, iterated or not."""

    def __init__(self, generations: list[Generation], n: int) -> None:
        self.generations, self.n = generations, n
        self._pieces = self._run()

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces

    async def aclose(self) -> None:
        await self._pieces.aclose()
        for g in self.generations:
            await g.aclose()

    async def _run(self) -> AsyncIterator[Piece]:
        streams = [aiter(g) for g in self.generations]
        pending = {asyncio.ensure_future(anext(s)): p for p, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.get):  # prompt order, where several are ready
                    p = pending.pop(task)
                    try:
                        piece = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(streams[p]))] = p
                    piece.index += p * self.n
                    yield piece
        finally:
            for task in pending:
                task.cancel()
            for task in pending:  # each generation unwinds (and aborts its choices) before we return
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
