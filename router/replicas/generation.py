"""One request's life in the router: send its choices to a replica, turn their token deltas into text
pieces (stop strings applied per choice), and abort them on the replica when the client goes away or a
stop string ends one."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster import AddRequest, ErrorKind, FirstTokenHops, TokenDelta, error_for
from router.chat.detokenizer import IncrementalDetokenizer
from router.replicas.migration import Migration, continuation, movable

log = logging.getLogger(__name__)

# for each prompt position after the first: the prompt token's logprob and the k most likely (id, logprob)
PromptLogprobs = list[tuple[float, list[tuple[int, float]]]]


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    index: int = 0  # the choice it belongs to
    first: bool = False  # its choice's first piece (where an echoed prompt goes)
    prompt_logprobs: PromptLogprobs | None = None  # on a first piece, when the request asked for them


@dataclass
class Timing:
    """When a request's tokens reached the router: the one measurement of its client-visible latencies.
    Over all its choices: the first token of any, the last of all, every choice's tokens and gaps."""

    arrival: float = field(default_factory=time.perf_counter)  # the HTTP request read off its connection
    # on the way to the first token (router/http/hops.py): the body parsed and validated, its token ids
    # ready, the request written to its replica's channel, the replica's own share (with its first
    # token), and that token's SSE chunk written to the client
    parsed: float | None = None
    tokenized: float | None = None
    submitted: float | None = None
    hops: FirstTokenHops | None = None
    first_chunk_written: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    # the gap before each token after its choice's first; tokens that arrive together (one piece of
    # several steps' tokens) have a gap of 0 after the first of them, as a client sees them
    gaps: list[float] = field(default_factory=list)
    _choices: dict[int, list] = field(default_factory=dict)  # index -> [first, last, tokens]

    def received(self, num_tokens: int, now: float, index: int = 0) -> None:
        if num_tokens == 0:
            return
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = [now, now, 0]
        else:
            self.gaps.append(now - choice[1])
        self.gaps.extend([0.0] * (num_tokens - 1))
        choice[1], choice[2] = now, choice[2] + num_tokens
        self.first_token = now if self.first_token is None else self.first_token
        self.last_token = now
        self.tokens += num_tokens

    @property
    def time_per_output_token(self) -> float | None:
        """Decode time per token after the first, averaged over the choices that have more than one."""
        per = [(last - first) / (n - 1) for first, last, n in self._choices.values() if n > 1]
        return sum(per) / len(per) if per else None


class Generation:
    """A request's choices on one replica, sent when this is made (so the replica's queue as the router
    counts it holds them from the moment they were admitted); iterating it yields the pieces of every
    choice (requests[i] is choice i, each with its own detokenizer) as they come, until all have ended,
    each choice's last piece carrying its finish_reason. A choice whose replica goes away continues on
    another (`migration`, router/replicas/migration.py) within its limit; a failed choice raises the
    RaylmError of its kind, and the others are aborted. `aclose` aborts what has not ended, iterated or
    not."""

    def __init__(
        self,
        client,
        requests: list[AddRequest],
        detoks: list[IncrementalDetokenizer],
        timing: Timing,
        migration: Migration | None = None,
    ) -> None:
        self.client, self.requests, self.detoks, self.timing = client, requests, detoks, timing
        self.migration = migration
        self.index = {r.uid: i for i, r in enumerate(requests)}
        # per choice: the client it runs on now, the tokens taken from its stream so far, and its moves
        self.clients = [client] * len(requests)
        self.sent: list[list[int]] = [[] for _ in requests]
        self.migrations = [0] * len(requests)
        # of the prompt's tokens, those choice 0 found in the replica's prefix cache (the others find the
        # whole prompt there, as it was prefilled once for all of them)
        self.cached_tokens = 0
        self.live = set(self.index)
        # sent in one flush, choice 0 first: the others wait on the replica for its prompt's pages
        first = requests[0]
        self.queue = client.submit(first.uid, first.input_ids, first.params, on_sent=self._sent)
        for r in requests[1:]:
            client.submit(r.uid, r.input_ids, r.params, after=r.after, queue=self.queue)
        self._pieces = self._run()

    def _sent(self, now: float) -> None:
        self.timing.submitted = now

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces

    async def aclose(self) -> None:
        await self._pieces.aclose()
        self.abort_live()  # a generator never started has run no finally

    def abort_live(self) -> None:
        for uid in self.live:  # a disconnect, a timeout, another choice's failure
            self.clients[self.index[uid]].abort(uid)
        self.live.clear()

    def _move(self, delta: TokenDelta) -> str | None:
        """Continues the failed (or drain-noticed, or handed-over, not finished) delta's choice on another
        replica; None once sent there, else why it cannot move (a failed request then fails with that said
        after the failure's own message; a notice is then ignored and the choice stays)."""
        m, i = self.migration, self.index[delta.uid]
        failed = self.clients[i]
        handed_to = None if delta.finished else getattr(failed, "moving", {}).pop(delta.uid, None)
        if handed_to is not None:  # a rebalance's notice (not counted as a move)
            # moved only while it still waits there: one whose first token (or end) came meanwhile stays
            if m is None or delta.uid not in failed.queued:
                return ""
            request = continuation(self.requests[i], self.sent[i], uid=-1)
            if (client := m.rehome(request, handed_to)) is None:
                return ""
            request.uid = m.next_uid()
            cause = "rebalanced"
        else:
            if m is None or not m.max_migrations or not movable(delta):
                return ""
            if self.migrations[i] >= m.max_migrations:
                return f"; it was moved to another replica {self.migrations[i]} time(s) already (max_migrations)"
            request = continuation(self.requests[i], self.sent[i], m.next_uid())
            if (client := m.reroute(request, failed)) is None:
                return "; no other replica could take it over"
            self.migrations[i] += 1
            cause = "drained" if getattr(failed, "draining", False) else "replica_down"
        self.live.discard(delta.uid)  # what its old replica still sends is dropped from here on
        failed.abort(delta.uid)  # a drained replica's: it serves on (a dead one's has let go already)
        self.clients[i], self.index[request.uid] = client, i
        self.live.add(request.uid)
        client.submit(request.uid, request.input_ids, request.params, queue=self.queue, output_len=request.output_len)
        m.counted(cause)
        log.info(
            "request %d continues on replica %d as %d after %d token(s) (%s)",
            self.requests[i].uid,
            client.replica_id,
            request.uid,
            len(self.sent[i]),
            cause if cause == "rebalanced" else f"move {self.migrations[i]}",
        )
        return None

    async def _run(self) -> AsyncIterator[Piece]:
        live, queue, detoks = self.live, self.queue, self.detoks
        prompt_logprobs: PromptLogprobs | None = None  # asked of one choice, shown with every choice
        started: set[int] = set()
        try:
            while live:
                deltas = [await queue.get()]
                # under load several steps' tokens wait here: send them as one piece per choice (one SSE event)
                while not queue.empty():
                    deltas.append(queue.get_nowait())
                prompt_logprobs = next(
                    (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), prompt_logprobs
                )
                pieces: dict[int, Piece] = {}
                for delta in deltas:
                    if delta.uid not in live:  # sent before its abort (a stop string) landed
                        continue
                    if delta.error is not None:
                        if (why := self._move(delta)) is None or not delta.finished:
                            continue  # moved: it goes on from another replica; a drain's notice: here
                        live.discard(delta.uid)
                        kind = delta.error_kind or ErrorKind.ENGINE
                        raise error_for(kind, delta.error + why, delta.error_field, delta.error_code)
                    i = self.index[delta.uid]
                    self.sent[i].append(delta.token)
                    if i == 0 and delta.cached_tokens is not None:
                        self.cached_tokens = delta.cached_tokens
                    if self.timing.hops is None and delta.hops is not None:  # the request's first token
                        self.timing.hops = delta.hops
                    piece = pieces.setdefault(i, Piece("", index=i))
                    if _add(piece, delta, detoks[i]):
                        live.discard(delta.uid)
                        if not delta.finished:  # a stop string: stop spending the replica's time
                            self.clients[i].abort(delta.uid)
                now = time.perf_counter()
                for i, piece in pieces.items():
                    if i not in started:
                        started.add(i)
                        piece.first, piece.prompt_logprobs = True, prompt_logprobs
                    self.timing.received(len(piece.token_ids), now, i)
                    yield piece
        finally:
            self.abort_live()


def _add(piece: Piece, delta: TokenDelta, detok: IncrementalDetokenizer) -> bool:
    """Adds delta's token to its choice's piece; whether the choice has ended."""
    piece.text += detok.add(delta.token, ends=delta.finished and delta.finish_reason == "stop")
    piece.token_ids.append(delta.token)
    if delta.logprob is not None:
        piece.logprobs.append(delta.logprob)
        piece.top_logprobs.append(delta.top_logprobs or [])
    if detok.stopped:
        piece.finish_reason = "stop"
    elif delta.finished:
        piece.text += detok.flush()
        piece.finish_reason = delta.finish_reason
    return piece.finish_reason is not None
