"""Serving one request's prompts: route and send each to a replica, then collect its pieces into one
body, or stream them as SSE events, aborting on the replicas whatever a disconnect, a timeout or a
failure leaves unfinished; the router's metrics and log line of each prompt."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from cluster import AddRequest, RaylmError, SamplingParams, fan_out
from router.chat.detokenizer import IncrementalDetokenizer
from router.http.errors import APIError
from router.http.guard import RECEIVED
from router.http.responses import Formatter, sse
from router.http.state import SEED_RANGE, RouterState
from router.replicas.generation import Generation, Timing
from router.replicas.merged import MergedGenerations
from router.replicas.migration import Migration
from router.replicas.routing import NoReplicaError, with_room

log = logging.getLogger("raylm.requests")


@dataclass(frozen=True)
class PromptRun:
    """One prompt of a request as its replica runs it."""

    ids: list[int]
    params: SamplingParams


@dataclass
class _Sent:
    """A prompt sent to its replica: where, and how it went (for the metrics and the log)."""

    run: PromptRun
    client: object
    generation: Generation
    timing: Timing
    reason: str = "abort"


def _send(
    state: RouterState, runs: list[PromptRun], body, stamps: tuple[float, float | None, float | None]
) -> list[_Sent]:
    """Routes and sends each prompt (each its own replica, as the policy picks); a 503 or 429 when one
    finds no replica or no room, the prompts already sent then aborted. `stamps`: when the request was
    received, parsed and tokenized (Timing's)."""
    bounds, sent = state.config.scheduler, []
    try:
        for run in runs:
            room = with_room(
                state.routable, len(run.ids), bounds.max_queued_requests, bounds.max_queued_tokens, run.params.n
            )
            client = state.policy.pick(room, run.ids)
            requests = _choices(state, run.ids, run.params)
            # stops apply per choice; what ends a request on the replica (EOS unless ignored, stop_token_ids)
            # is left out of its text
            ends = frozenset(run.params.stop_token_ids) | frozenset(() if run.params.ignore_eos else state.eos_ids)
            detoks = [
                IncrementalDetokenizer(
                    state.tokenizer,
                    body.stop_list,
                    body.skip_special_tokens,
                    ends,
                    run.params.min_tokens,
                    run.ids,
                    include_stops=bool(body.include_stop_str_in_output),
                )
                for _ in requests
            ]
            received, parsed, tokenized = stamps
            timing = Timing(arrival=received, parsed=parsed, tokenized=tokenized)
            # sent now, before the response starts: the next request's room check counts these
            sent.append(_Sent(run, client, Generation(client, requests, detoks, timing, _migration(state)), timing))
    except (NoReplicaError, RaylmError) as e:
        for s in sent:
            s.generation.abort_live()
        if isinstance(e, NoReplicaError):
            raise APIError(503, str(e), "service_unavailable") from e
        # every queue is full: a 429 before anything is sent, a stream's included
        state.metrics.ended("rejected")
        raise APIError.of(e) from e
    return sent


def _migration(state: RouterState) -> Migration:
    """How a request's choices move when their replica goes away: to a replica the policy picks among the
    others that route and have room."""
    bounds = state.config.scheduler

    def reroute(request: AddRequest, failed) -> object | None:
        if state.draining:  # the server is stopping: nothing is moved onto replicas about to stop
            return None
        others = [c for c in state.routable if c is not failed]
        try:
            room = with_room(others, len(request.input_ids), bounds.max_queued_requests, bounds.max_queued_tokens)
        except (NoReplicaError, RaylmError):
            return None
        return state.policy.pick(room, request.input_ids)

    def counted(cause: str) -> None:
        state.metrics.migrations.labels(state.model_name, cause).inc()

    def rehome(request: AddRequest, to) -> object | None:
        if state.draining or not to.healthy or to not in state.routable:
            return None
        return to if to.has_room(len(request.input_ids), bounds.max_queued_requests, bounds.max_queued_tokens) else None

    return Migration(state.config.max_migrations, reroute, lambda: next(state.uids), counted, rehome)


async def serve(
    state: RouterState, request: Request, body, runs: list[PromptRun], fmt: Formatter, parsed: float | None = None
):
    """`parsed`: when the handler had the body validated (None: a route whose body is not the router's
    own to parse, its parse and tokenize hops unknown)."""
    now = time.perf_counter()
    received = request.scope.get(RECEIVED, now)
    sent = _send(state, runs, body, (received, parsed, now if parsed is not None else None))
    prompt_tokens = sum(len(r.ids) for r in runs)
    options = body.stream_options
    include_usage = bool(options is not None and options.include_usage) or fmt.extras.continuous_usage
    generations = [s.generation for s in sent]
    pieces = generations[0] if len(sent) == 1 else MergedGenerations(generations, fmt.n)
    for _ in sent:
        state.metrics.running.labels(state.model_name).inc()
    ended = False

    def done() -> None:
        """Runs once however the request ends (a stream's client may leave before its body starts)."""
        nonlocal ended
        if ended:
            return
        ended = True
        for s in sent:
            state.metrics.running.labels(state.model_name).dec()
            state.metrics.finished(s.reason, len(s.run.ids), s.timing)
            log.info(
                "request %s replica=%s prompt_tokens=%d completion_tokens=%d ttft=%.4f latency=%.4f finish=%s",
                fmt.id,
                # where its choices ended: another than it was sent to after a migration
                ",".join(str(r) for r in sorted({c.replica_id for c in s.generation.clients})),
                len(s.run.ids),
                s.timing.tokens,
                (s.timing.first_token or s.timing.arrival) - s.timing.arrival,
                (s.timing.last_token or s.timing.arrival) - s.timing.arrival,
                s.reason,
            )

    def outcome(reason: str) -> None:
        for s in sent:
            s.reason = reason

    async def finish() -> None:
        try:
            await pieces.aclose()  # aborts on the replica whatever has not ended
        finally:
            done()

    if body.stream:
        return _EventStream(_stream(state, pieces, fmt, prompt_tokens, include_usage, sent, outcome, finish), finish)
    try:
        collected = await _until_disconnect(request, _collect(pieces), state.config.request_timeout_s)
        for p, s in enumerate(sent):
            own = range(p * fmt.n, (p + 1) * fmt.n)
            s.reason = _request_reason([c.finish_reason for c in collected if c.index in own and c.finish_reason])
    except TimeoutError as e:
        outcome("timeout")
        raise APIError(408, f"the request took longer than {state.config.request_timeout_s} s", "timeout_error") from e
    except RaylmError as e:
        outcome("error")
        raise APIError.of(e) from e
    finally:
        await finish()
    return fmt.whole(collected, prompt_tokens, _cached_tokens(sent))


def _choices(state: RouterState, ids: list[int], params: SamplingParams) -> list[AddRequest]:
    """The request's choices as the replica runs them, one uid each, choice 0 first."""
    if params.seed is None and params.temperature > 0 and state.config.max_migrations:
        # drawn here, not by the replica, so that a stream moved to another replica draws on as it would have
        params = dataclasses.replace(params, seed=random.randrange(SEED_RANGE))
    requests = fan_out(state.uids, ids, params)
    # the later choices find the prompt in the prefix cache, without its logits: choice 0 scores it
    for r in requests[1:]:
        if r.params.prompt_logprobs is not None:
            r.params = dataclasses.replace(r.params, prompt_logprobs=None)
    return requests


def _cached_tokens(sent: list[_Sent]) -> int:
    """The request's prompt tokens served from the replicas' prefix caches, over its prompts."""
    return sum(s.generation.cached_tokens for s in sent)


def _request_reason(reasons: list[str]) -> str:
    """One finish reason for a request's metrics and log line: its choices' when all stopped, otherwise
    the first other one (a choice cut at max_tokens makes it "length")."""
    return next((r for r in reasons if r != "stop"), "stop")


def _written(timing: Timing) -> None:
    if timing.first_chunk_written is None:
        timing.first_chunk_written = time.perf_counter()


async def _collect(pieces) -> list:
    return [piece async for piece in pieces]


async def _until_disconnect(request: Request, work, timeout_s: float | None):
    """Runs work, cancelling it when the client disconnects (its request is then aborted)."""
    task = asyncio.ensure_future(asyncio.wait_for(work, timeout_s))
    try:
        while not task.done():
            watcher = asyncio.ensure_future(request.is_disconnected())
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
            if watcher.done() and watcher.result() and not task.done():
                await _cancelled(task)
                raise APIError(499, "client closed the request")
            watcher.cancel()
    except asyncio.CancelledError:
        # this handler cancelled (a server forced to stop): the generation unwinds first, or closing it
        # after would find it still running
        await _cancelled(task)
        raise
    return task.result()


async def _cancelled(task: asyncio.Future) -> None:
    """Cancels task and waits until it has unwound (and its generation aborted)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class _EventStream(StreamingResponse):
    """An SSE response that runs `finish` however it ends: a client that leaves before the body starts
    leaves the body's generator unstarted, and its own `finally` never runs."""

    def __init__(self, body, finish) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.finish = finish
        self.endings: list[Callable[[], Awaitable[None]]] = []

    def then(self, ending: Callable[[], Awaitable[None]]) -> None:
        """Runs `ending` once the stream is over, however it ends: a body rewritten over this one
        (chat_bridge's restream) may be cut where its own code never resumes, by a client that left."""
        self.endings.append(ending)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.finish()
            finally:
                for ending in self.endings:
                    await ending()


async def _stream(
    state: RouterState,
    pieces,
    fmt: Formatter,
    prompt_tokens: int,
    include_usage: bool,
    sent: list[_Sent],
    outcome,
    finish,
):
    completion, reasons = 0, [[] for _ in sent]
    try:
        yield "".join(fmt.role_chunks()) if fmt.chat else ""
        async with asyncio.timeout(state.config.request_timeout_s):
            async for piece in pieces:
                completion += len(piece.token_ids)
                if piece.finish_reason is not None:
                    p = piece.index // fmt.n
                    reasons[p].append(piece.finish_reason)
                    if len(reasons[p]) == fmt.n:  # until then a disconnect still aborts the rest
                        sent[p].reason = _request_reason(reasons[p])
                if (
                    piece.text
                    or piece.finish_reason is not None
                    or piece.logprobs
                    or fmt.echoes(piece)
                    or (fmt.extras.in_stream and piece.token_ids)
                ):
                    if event := fmt.chunk_sse(piece):  # "": a parser holds its text back for now
                        yield event
                        if piece.token_ids:  # resumed once the server has written it
                            _written(sent[piece.index // fmt.n].timing)
        if include_usage:
            yield sse(fmt.usage_chunk(prompt_tokens, completion, _cached_tokens(sent)))
        yield sse("[DONE]")
    except TimeoutError:
        outcome("timeout")
        yield sse(
            APIError(408, f"the request took longer than {state.config.request_timeout_s} s", "timeout_error").event()
        )
        yield sse("[DONE]")
    except RaylmError as e:
        outcome("error")
        yield sse(APIError.of(e).event())
        yield sse("[DONE]")
    except Exception as e:  # noqa: BLE001 - a fault of the router's own: the stream ends with it said, not cut
        log.exception("request %s failed while streaming", fmt.id)
        outcome("error")
        yield sse(APIError(500, f"internal error: {type(e).__name__}", "server_error").event())
        yield sse("[DONE]")
    finally:
        await finish()  # a disconnect mid-stream lands here too
