"""What crosses a replica's boundary: what a replica tells its callers once it has started, and the
batch of deltas per step (one delta per request that got a token)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import ErrorKind


@dataclass
class TokenDelta:
    uid: int
    token: int | None               # None when the request ended without a token (error, rejection)
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort or error
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None          # why the request failed (finish_reason "error")
    error_kind: ErrorKind | None = None

    @classmethod
    def failure(cls, uid: int, kind: ErrorKind, why: str) -> TokenDelta:
        """The last delta of a request that failed."""
        return cls(uid, None, finished=True, finish_reason="error", error=why, error_kind=kind)


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica tells the router about its model and cache."""

    max_seq_len: int
    num_pages: int
    page_size: int
    vocab_size: int
    eos_ids: tuple[int, ...]
