"""The FastAPI application: OpenAI-compatible routes over the replicas held in RouterState."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.chat.prepare import prepare_chat
from router.chat.structured import request_grammar
from router.http.chat_bridge import chat_request, prompt_ids
from router.http.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    internal_error_handler,
    validation_error_handler,
)
from router.http.extras import Extras
from router.http.guard import RequestGuard
from router.http.head import HeadAsGet
from router.http.messages_api.service import count_tokens, create_message
from router.http.prompts import COMPLETION_MAX_TOKENS, completion_prompts, prompt_count, truncated
from router.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from router.http.responses import Formatter, PromptShown
from router.http.responses_api.protocol import InputTokensRequest, ResponsesRequest
from router.http.responses_api.service import (
    cancel_response,
    count_input_tokens,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from router.http.serving import PromptRun, serve
from router.http.state import RouterState


def build_app(state: RouterState, background: list | None = None) -> FastAPI:
    """`background`: coroutine functions run for the app's lifetime (the replica supervisor)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
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
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(RequestGuard, state=state)
    app.add_middleware(HeadAsGet)

    @app.get("/health")
    async def health():
        down = {str(c.replica_id): c.error for c in state.clients if not c.healthy}
        # drained by an operator or retiring (a scale-down): up, but taking no new request
        routable = state.routable
        held = sorted(c.replica_id for c in state.clients if c not in routable)
        if down or not routable or state.draining or state.control_store_error:
            # down: replica id -> why (it is being replaced)
            body = {"status": "unavailable", "replicas_down": down}
            if held:
                body["replicas_drained"] = held
            if state.control_store_error:
                body["cluster"] = state.control_store_error
            return JSONResponse(body, status_code=503)
        body = {"status": "ok", "replicas": len(state.clients)}
        return body | {"replicas_drained": held} if held else body

    @app.get("/metrics")
    async def metrics():
        await state.metrics.replica_gauges.refresh(state.clients)
        return PlainTextResponse(state.metrics.exposition().decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = _model_card(state)
        # Anthropic's list fields beside OpenAI's: either client reads its own
        return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

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
            fields = {name: getattr(body, name) for name in TokenizeRequest.CHAT_FIELDS}
            ids = prompt_ids(state, chat_request({"model": state.model_name, **fields}))
        else:
            ids = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False).input_ids
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
        parsed = time.perf_counter()  # the body read and validated: what is left to do is the router's own
        state.check_model(body.model)
        extras = _extras(body)
        _check_sequences(body, state.config.max_prompts)
        prompts = completion_prompts(body, state.tokenizer, state.vocab_size, state.max_seq_len)
        grammar = request_grammar(body)
        # an echo with logprobs shows the prompt's too: the replica scores the prompt for them
        scored = _most(body.logprobs if body.echo else None, extras.prompt_logprobs)
        runs = []
        for i, prompt in enumerate(prompts):  # every prompt checked before any runs
            try:
                params = state.sampling_params(
                    body, prompt.ids, body.max_tokens, COMPLETION_MAX_TOKENS, body.logprobs, scored, grammar=grammar
                )
            except APIError as e:
                if len(prompts) > 1:
                    e.message = f"prompt {i}: {e.message}"
                raise
            runs.append(PromptRun(prompt.ids, params))
        shown = [PromptShown(p.ids, p.text) for p in prompts]
        fmt = Formatter(
            f"cmpl-{uuid.uuid4().hex}",
            state.model_name,
            False,
            state.tokenizer,
            body.logprobs,
            runs[0].params.n,
            shown,
            extras=extras,
        )
        return await serve(state, request, body, runs, fmt, parsed)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        parsed = time.perf_counter()
        state.check_model(body.model)
        extras = _extras(body)
        chat = prepare_chat(state, body)
        ids = truncated(chat.ids, body, state.max_seq_len, body.max_completion_tokens or body.max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = state.sampling_params(
            body,
            ids,
            body.max_completion_tokens or body.max_tokens,
            None,
            top,
            extras.prompt_logprobs,
            grammar=chat.grammar,
            max_tokens_field="max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
        )
        fmt = Formatter(
            f"chatcmpl-{uuid.uuid4().hex}",
            state.model_name,
            True,
            state.tokenizer,
            top,
            params.n,
            [PromptShown(ids)],
            output=chat.output,
            extras=extras,
        )
        return await serve(state, request, body, [PromptRun(ids, params)], fmt, parsed)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(state, request, body)

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(body: InputTokensRequest):
        return await count_input_tokens(state, body)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, stream: bool = False):
        if stream:  # OpenAI streams a background response again from its events; this server runs none
            why = "only a background response can be streamed again, and this server runs none"
            raise APIError(400, f"stream: {why}", param="stream")
        return await get_response(state, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def responses_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        return await list_input_items(state, response_id, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        return await delete_response(state, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str):
        return await cancel_response(state, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await create_message(state, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        return await count_tokens(state, request)

    return app


def _extras(body: SamplingFields) -> Extras:
    """The request's vLLM additions to its response (a 400 for prompt_logprobs in a stream, as vLLM's)."""
    options = body.stream_options
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    return Extras(
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        prompt_logprobs=body.prompt_logprobs,
        # vLLM's include_usage defaults to true where stream_options are sent
        continuous_usage=options is not None
        and options.continuous_usage_stats is True
        and options.include_usage is not False,
        skip_special_tokens=body.skip_special_tokens,
    )


def _check_sequences(body: CompletionRequest, max_prompts: int) -> None:
    """Refuses, before any work, a request whose prompts times n (each choice of each prompt a sequence)
    pass max_prompts: 2,048 prompts at n 16 held a replica's every slot for minutes."""
    listed, n = prompt_count(body.prompt), 1 if body.n is None else body.n
    if listed > max_prompts:
        raise APIError(400, f"prompt lists {listed} prompts; at most {max_prompts} are allowed", param="prompt")
    if listed * n > max_prompts:
        raise APIError(
            400,
            f"n is {n} for each of {listed} prompts, {listed * n} sequences; at most {max_prompts} "
            f"(prompts times n) are allowed",
            param="n",
        )


def _most(*ks: int | None) -> int | None:
    """The most prompt logprobs any use asks for (None: none)."""
    given = [k for k in ks if k is not None]
    return max(given) if given else None


def _model_card(state: RouterState) -> dict:
    """OpenAI's model object, with Anthropic's fields beside (`type`, `display_name`, `created_at`), so
    that the anthropic client's models.list and retrieve read it too."""
    created = datetime.datetime.fromtimestamp(state.created, datetime.UTC)
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "raylm",
        "max_model_len": state.max_seq_len,
        "type": "model",
        "display_name": state.model_name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }


def _version() -> str:
    try:
        return importlib.metadata.version("raylm")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"
