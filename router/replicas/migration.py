"""Mid-stream migration: a choice whose replica died (or was drained) with its stream unfinished
continues on another replica. Its prompt and every token the router has already taken from it are sent
there as one prompt, the sent tokens marked as output (AddRequest.output_len), so that the replica
prefills them (its prefix cache may hold most of them) and decodes on as the first would have: the same
seed at the same positions draws the same tokens (worker/sampling/sampler.py), penalties and min_tokens
count the sent tokens, max_tokens is what is left of it, and a grammar's matcher is advanced over them.
The router's detokenizer, stop strings and logprobs carry on untouched, so the client sees one stream."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from cluster import AddRequest, ErrorKind, TokenDelta


def continuation(original: AddRequest, sent: list[int], uid: int) -> AddRequest:
    """`original` (as first sent: its whole prompt, no output) continued under a new `uid` after `sent`
    reached the client. Prompt logprobs went out with the first token: a continuation that has sent
    one does not ask for them again; one that has sent none is the original request again."""
    params = original.params
    if sent and params.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return AddRequest(uid, original.input_ids + sent, params, output_len=len(sent))


@dataclass
class Migration:
    """What a generation needs to move its choices: the limit per choice (0: never move), where to send
    a continuation (`reroute(request, failed)`: another replica's client, or None when no replica can
    take it), new request ids, a callback counting each move by its cause, and whether a waiting request
    a rebalance hands over may go where it is handed (`rehome(request, to)`: `to`, or None when it is
    no longer routed to or has no room; router/replicas/rebalance.py)."""

    max_migrations: int
    reroute: Callable[[AddRequest, object], object | None]
    next_uid: Callable[[], int]
    counted: Callable[[str], None] = lambda cause: None
    rehome: Callable[[AddRequest, object], object | None] = lambda request, to: None


def movable(delta: TokenDelta) -> bool:
    """Whether a failed delta's choice may move: its replica went away (it died, broke, or was drained),
    not a failure a move would not help (a bad request, an engine error, an overloaded queue)."""
    return delta.error_kind is ErrorKind.REPLICA_DOWN
