"""The FastAPI application: OpenAI-compatible routes over the replicas held in RouterState."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import AddRequest, RaylmError, SamplingParams, fan_out
from router.chat.detokenizer import IncrementalDetokenizer
from router.chat.prepare import prepare_chat
from router.chat.structured import request_grammar
from router.http.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from router.http.guard import RequestGuard
from router.http.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.http.responses import Echo, Formatter, sse
from router.http.state import RouterState
from router.replicas.generation import Generation, Timing
from router.replicas.routing import NoReplicaError, with_room

log = logging.getLogger("raylm.requests")


def build_app(state: RouterState, background: list | None = None) -> FastAPI:
    """`background`: coroutine functions run for the app's lifetime (the replica supervisor)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for client in state.clients:
            client.start()
        tasks = [asyncio.get_running_loop().create_task(fn()) for fn in background or []]
        yield
        state.draining = True
        for task in tasks:
            task.cancel()
        for client in state.clients:
            await client.stop()

    app = FastAPI(title="raylm", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(RequestGuard, state=state)

    @app.get("/health")
    async def health():
        down = {str(c.replica_id): c.error for c in state.clients if not c.healthy}
        if down or not state.clients or state.draining or state.control_store_error:
            # down: replica id -> why (it is being replaced)
            body = {"status": "unavailable", "replicas_down": down}
            if state.control_store_error:
                body["cluster"] = state.control_store_error
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "replicas": len(state.clients)}

    @app.get("/metrics")
    async def metrics():
        await state.metrics.replica_gauges.refresh(state.clients)
        return PlainTextResponse(state.metrics.exposition().decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.check_model(model_id)
        return _model_card(state)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            state.check_model(body.model)
        if body.messages is not None:
            ids = state.chat_ids(
                ChatCompletionRequest(model=state.model_name, messages=body.messages),
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            ids = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(
                400, f"token id {bad[0]} is outside the vocabulary (0..{state.vocab_size - 1})", param="tokens"
            )
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        ids = state.completion_ids(body)
        # an echo with logprobs shows the prompt's too: the replica scores the prompt for them
        params = state.sampling_params(
            body,
            ids,
            body.max_tokens,
            16,
            body.logprobs,
            body.logprobs if body.echo else None,
            grammar=request_grammar(body),
        )
        echo = Echo(state.prompt_text(body, ids), ids) if body.echo else None
        fmt = Formatter(
            f"cmpl-{uuid.uuid4().hex}", state.model_name, False, state.tokenizer, body.logprobs, params.n, echo
        )
        return await _serve(state, request, body, ids, params, fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        chat = prepare_chat(state, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = state.sampling_params(
            body, chat.ids, body.max_completion_tokens or body.max_tokens, None, top, grammar=chat.grammar
        )
        fmt = Formatter(
            f"chatcmpl-{uuid.uuid4().hex}", state.model_name, True, state.tokenizer, top, params.n, output=chat.output
        )
        return await _serve(state, request, body, chat.ids, params, fmt)

    return app


def _model_card(state: RouterState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "raylm",
        "max_model_len": state.max_seq_len,
    }


def _version() -> str:
    try:
        return importlib.metadata.version("raylm")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


async def _serve(state: RouterState, request: Request, body, ids, params, fmt: Formatter):
    bounds = state.config.scheduler
    try:
        room = with_room(state.clients, len(ids), bounds.max_queued_requests, bounds.max_queued_tokens, params.n)
        client = state.policy.pick(room, ids)
    except NoReplicaError as e:
        raise APIError(503, str(e), "service_unavailable") from e
    except RaylmError as e:  # every queue is full: a 429 before anything is sent, a stream's included
        state.metrics.requests.labels(state.model_name, "rejected").inc()
        raise APIError.of(e) from e
    requests = _choices(state, ids, params)
    timing = Timing()
    detoks = [IncrementalDetokenizer(state.tokenizer, body.stop_list) for _ in requests]  # stops apply per choice
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    # sent now, before the response starts: the next request's room check counts these
    pieces = Generation(client, requests, detoks, timing)
    state.metrics.running.labels(state.model_name).inc()
    outcome = {"reason": "abort"}
    ended = False

    def done() -> None:
        """Runs once however the request ends (a stream's client may leave before its body starts)."""
        nonlocal ended
        if ended:
            return
        ended = True
        state.metrics.running.labels(state.model_name).dec()
        state.metrics.finished(outcome["reason"], len(ids), timing)
        log.info(
            "request %s replica=%d prompt_tokens=%d completion_tokens=%d ttft=%.4f latency=%.4f finish=%s",
            fmt.id,
            client.replica_id,
            len(ids),
            timing.tokens,
            (timing.first_token or timing.arrival) - timing.arrival,
            (timing.last_token or timing.arrival) - timing.arrival,
            outcome["reason"],
        )

    async def finish() -> None:
        try:
            await pieces.aclose()  # aborts on the replica whatever has not ended
        finally:
            done()

    if body.stream:
        return _EventStream(_stream(state, pieces, fmt, len(ids), include_usage, outcome, finish), finish)
    try:
        collected = await _until_disconnect(request, _collect(pieces), state.config.request_timeout_s)
        outcome["reason"] = _request_reason([p.finish_reason for p in collected if p.finish_reason is not None])
    except TimeoutError as e:
        outcome["reason"] = "timeout"
        raise APIError(408, f"the request took longer than {state.config.request_timeout_s} s", "timeout_error") from e
    except RaylmError as e:
        outcome["reason"] = "error"
        raise APIError.of(e) from e
    finally:
        await finish()
    return fmt.whole(collected, len(ids))


def _choices(state: RouterState, ids: list[int], params: SamplingParams) -> list[AddRequest]:
    """The request's choices as the replica runs them, one uid each, choice 0 first."""
    requests = fan_out(state.uids, ids, params)
    # the later choices find the prompt in the prefix cache, without its logits: choice 0 scores it
    for r in requests[1:]:
        if r.params.prompt_logprobs is not None:
            r.params = dataclasses.replace(r.params, prompt_logprobs=None)
    return requests


def _request_reason(reasons: list[str]) -> str:
    """One finish reason for a request's metrics and log line: its choices' when all stopped, otherwise
    the first other one (a choice cut at max_tokens makes it "length")."""
    return next((r for r in reasons if r != "stop"), "stop")


async def _collect(pieces) -> list:
    return [piece async for piece in pieces]


async def _until_disconnect(request: Request, work, timeout_s: float | None):
    """Runs work, cancelling it when the client disconnects (its request is then aborted)."""
    task = asyncio.ensure_future(asyncio.wait_for(work, timeout_s))
    while not task.done():
        watcher = asyncio.ensure_future(request.is_disconnected())
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
        if watcher.done() and watcher.result() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # let the generation unwind (and abort) before anything else touches it
            raise APIError(499, "client closed the request")
        watcher.cancel()
    return task.result()


class _EventStream(StreamingResponse):
    """An SSE response that runs `finish` however it ends: a client that leaves before the body starts
    leaves the body's generator unstarted, and its own `finally` never runs."""

    def __init__(self, body, finish) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.finish = finish

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.finish()


async def _stream(
    state: RouterState, pieces, fmt: Formatter, prompt_tokens: int, include_usage: bool, outcome: dict, finish
):
    completion, reasons = 0, []
    try:
        yield "".join(fmt.role_chunks()) if fmt.chat else ""
        async with asyncio.timeout(state.config.request_timeout_s):
            async for piece in pieces:
                completion += len(piece.token_ids)
                if piece.finish_reason is not None:
                    reasons.append(piece.finish_reason)
                    if len(reasons) == fmt.n:  # until then a disconnect still aborts the rest
                        outcome["reason"] = _request_reason(reasons)
                if piece.text or piece.finish_reason is not None or piece.logprobs or fmt.echoes(piece):
                    if event := fmt.chunk_sse(piece):  # "": a parser holds its text back for now
                        yield event
        if include_usage:
            yield sse(fmt.usage_chunk(prompt_tokens, completion))
        yield sse("[DONE]")
    except TimeoutError:
        outcome["reason"] = "timeout"
        yield sse(
            APIError(408, f"the request took longer than {state.config.request_timeout_s} s", "timeout_error").event()
        )
        yield sse("[DONE]")
    except RaylmError as e:
        outcome["reason"] = "error"
        yield sse(APIError.of(e).event())
        yield sse("[DONE]")
    finally:
        await finish()  # a disconnect mid-stream lands here too
