"""One request's life in the router: send it to a replica, turn its token deltas into text pieces
(stop strings applied), and abort it on the replica when the client goes away or a stop string ends it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from cluster import ErrorKind, SamplingParams, error_for
from router.detokenizer import IncrementalDetokenizer


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Timing:
    """When a request's tokens reached the router: the one measurement of its client-visible latencies."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    # the gap before each token after the first; tokens that arrive together (one piece of several
    # steps' tokens) have a gap of 0 after the first of them, as a client sees them
    gaps: list[float] = field(default_factory=list)

    def received(self, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        if self.first_token is None:
            self.first_token = now
            num_tokens -= 1
        else:
            self.gaps.append(now - self.last_token)
            num_tokens -= 1
        self.gaps.extend([0.0] * num_tokens)
        self.last_token = now
        self.tokens = len(self.gaps) + 1


async def generate(client, uid: int, ids: list[int], params: SamplingParams, detok: IncrementalDetokenizer,
                   timing: Timing) -> AsyncIterator[Piece]:
    """Yields pieces until the request ends; the last one carries finish_reason. A failed request
    raises the RaylmError of its kind."""
    queue = client.submit(uid, ids, params)
    finished = False
    try:
        while True:
            deltas = [await queue.get()]
            # under load several steps' tokens wait here: send them as one piece (one SSE event)
            while not queue.empty() and not deltas[-1].finished:
                deltas.append(queue.get_nowait())
            piece = Piece("")
            for delta in deltas:
                if delta.error is not None:
                    finished = True
                    raise error_for(delta.error_kind or ErrorKind.ENGINE, delta.error)
                piece.text += detok.add(delta.token)
                piece.token_ids.append(delta.token)
                if delta.logprob is not None:
                    piece.logprobs.append(delta.logprob)
                    piece.top_logprobs.append(delta.top_logprobs or [])
                if detok.stopped:
                    piece.finish_reason = "stop"
                    break
                if delta.finished:
                    piece.text += detok.flush()
                    piece.finish_reason = delta.finish_reason
            finished = deltas[-1].finished
            timing.received(len(piece.token_ids), time.perf_counter())
            yield piece
            if piece.finish_reason is not None:
                return
    finally:
        if not finished:  # a stop string, a disconnect, a timeout: stop spending the replica's time
            client.abort(uid)
