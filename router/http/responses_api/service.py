"""POST /v1/responses: the request translated into a chat request, served by the chat path, and its
result written as a Response object or the Responses API's event stream."""

from __future__ import annotations

from fastapi import Request

from router.http.chat_bridge import renamed, run_chat
from router.http.errors import APIError
from router.http.responses_api.output import ResponseHead, items_of, status_of, usage
from router.http.responses_api.protocol import ResponsesRequest
from router.http.responses_api.stream import ResponseEvents
from router.http.responses_api.translate import chat_of
from router.http.state import RouterState

# the chat fields a shared check may name, as the Responses API calls them
FIELD_NAMES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


async def create_response(state: RouterState, request: Request, req: ResponsesRequest):
    state.check_model(req.model)
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported by this server", param="previous_response_id")
    try:
        chat = chat_of(req, [])
        result = await run_chat(state, request, chat)
    except APIError as e:
        raise renamed(e, FIELD_NAMES) from None
    head = ResponseHead(req, state.model_name)
    count = lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids) if text else 0  # noqa: E731
    if result.body is None:
        events = ResponseEvents(head, count)
        return result.restream(events.events)
    choice, used = result.body["choices"][0], result.body["usage"]
    status, incomplete = status_of(choice["finish_reason"])
    message = choice["message"]
    reasoning = count(message.get("reasoning_content") or "")
    return head.body(
        status,
        items_of(message, status),
        usage(used["prompt_tokens"], used["completion_tokens"], reasoning),
        incomplete,
    )
