"""What the scheduler sends back: one batch of deltas per step, one delta per request that got a token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenDelta:
    uid: int
    token: int | None               # None when the request ended without a token (error, rejection)
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort or error
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
