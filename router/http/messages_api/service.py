"""POST /v1/messages and /v1/messages/count_tokens: the request translated into a chat request, served
by the chat path, its result written as an Anthropic message or event stream; every error in
Anthropic's shape, naming the field."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from router.http.chat_bridge import Origins, cached_of, prompt_ids, renamed, run_chat
from router.http.errors import APIError, validation_error
from router.http.messages_api.output import (
    blocks_of,
    error_response,
    json_response,
    message_body,
    new_id,
    stop_of,
    usage,
)
from router.http.messages_api.protocol import CountTokensRequest, MessagesRequest
from router.http.messages_api.stream import MessageEvents
from router.http.messages_api.translate import chat_of
from router.http.state import RouterState

# the chat fields a shared check may name, as the Messages API calls them
FIELD_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "tool_choice": "tool_choice",
    "tools.*.function.parameters": "tools.*.input_schema",
    "tools.*.function.name": "tools.*.name",
    "tools.*.function.strict": "tools.*.strict",
}


async def _parsed(request: Request, model: type[BaseModel]):
    body = None
    try:
        body = json.loads(await request.body())
        return model.model_validate(body)
    except RecursionError as e:
        raise APIError(400, "the body is not JSON this server reads: it is nested too deeply") from e
    except ValueError as e:
        if not isinstance(e, ValidationError):
            raise APIError(400, f"the body is not JSON: {e}") from e
        where, msg = validation_error(e.errors(), body)
        raise APIError(400, f"{where}: {msg}" if where else msg, param=where or None) from e


async def create_message(state: RouterState, request: Request):
    try:  # the request's own fields: errors name them as sent
        req = await _parsed(request, MessagesRequest)
        state.check_model(req.model)
    except APIError as e:
        return error_response(e)
    origins = Origins()
    try:  # the chat path's checks: errors name its fields as this API calls them
        result = await run_chat(state, request, chat_of(req, origins))
    except APIError as e:
        return error_response(renamed(origins.named(e), FIELD_NAMES))
    stops = req.stop_sequences or []
    eos = set(state.eos_ids)

    def stop(finish_reason, token_ids):
        return stop_of(finish_reason, token_ids, eos, stops, state.tokenizer)

    if result.body is None:
        events = MessageEvents(new_id(), state.model_name, len(result.prompt_ids), stop)
        return result.restream(events.events)
    choice, used = result.body["choices"][0], result.body["usage"]
    body = message_body(
        new_id(),
        state.model_name,
        blocks_of(choice["message"]),
        stop(choice["finish_reason"], choice.get("token_ids") or []),
        usage(used["prompt_tokens"], used["completion_tokens"], cached_of(used)),
    )
    return json_response(body)


async def count_tokens(state: RouterState, request: Request):
    try:
        req = await _parsed(request, CountTokensRequest)
        state.check_model(req.model)
    except APIError as e:
        return error_response(e)
    origins = Origins()
    try:
        return {"input_tokens": len(prompt_ids(state, chat_of(req, origins)))}
    except APIError as e:
        return error_response(renamed(origins.named(e), FIELD_NAMES))
