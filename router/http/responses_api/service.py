"""POST /v1/responses: the request translated into a chat request, served by the chat path, and its
result written as a Response object or the Responses API's event stream."""

from __future__ import annotations

from fastapi import Request

from router.http.chat_bridge import Origins, cached_of, prompt_ids, renamed, run_chat
from router.http.errors import APIError
from router.http.responses_api.output import ResponseHead, items_of, status_of, usage
from router.http.responses_api.protocol import InputTokensRequest, ResponsesRequest
from router.http.responses_api.store import forget, input_items, keep, stored
from router.http.responses_api.stream import ResponseEvents
from router.http.responses_api.translate import chat_of, input_messages
from router.http.state import RouterState

# the chat fields a shared check may name, as the Responses API calls them
FIELD_NAMES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "tools.*.function.parameters": "tools.*.parameters",
    "tools.*.function.strict": "tools.*.strict",
}


async def conversation(state: RouterState, req: ResponsesRequest) -> tuple[list[dict], Origins]:
    """The chat messages a request continues with: its previous response's conversation, then its input;
    and where each came from."""
    history = []
    if req.previous_response_id is not None:
        history = (await stored(state, req.previous_response_id, "previous_response_id"))["messages"]
    origins = Origins()
    for _ in history:
        origins.add("previous_response_id", calls_at="previous_response_id")
    try:
        return history + input_messages(req.input, history, origins=origins), origins
    except APIError as e:
        raise renamed(e, FIELD_NAMES) from None


async def create_response(state: RouterState, request: Request, req: ResponsesRequest):
    state.check_model(req.model)
    messages, origins = await conversation(state, req)
    try:
        result = await run_chat(state, request, chat_of(req, messages, origins))
    except APIError as e:
        raise renamed(origins.named(e), FIELD_NAMES) from None
    head = ResponseHead(req, state.model_name)
    count = lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids) if text else 0  # noqa: E731
    given = input_items(req.input)
    finished = (lambda body: keep(state, body, messages, given)) if req.store is not False else None
    if result.body is None:
        events = ResponseEvents(head, count, finished)
        return result.restream(events.events, events.left)
    choice, used = result.body["choices"][0], result.body["usage"]
    status, incomplete = status_of(choice["finish_reason"])
    message = choice["message"]
    reasoning = count(message.get("reasoning_content") or "")
    body = head.body(
        status,
        items_of(message, status),
        usage(used["prompt_tokens"], used["completion_tokens"], reasoning, cached_of(used)),
        incomplete,
    )
    if finished is not None:
        await finished(body)
    return body


async def get_response(state: RouterState, response_id: str) -> dict:
    return (await stored(state, response_id))["response"]


async def count_input_tokens(state: RouterState, req: InputTokensRequest) -> dict:
    """The prompt tokens the request would be: its input after its previous response's conversation,
    with its instructions and tools, rendered as POST /v1/responses renders them."""
    if req.model is not None:
        state.check_model(req.model)
    messages, origins = await conversation(state, req)
    try:
        ids = prompt_ids(state, chat_of(req.model_copy(update={"model": state.model_name}), messages, origins))
    except APIError as e:
        raise renamed(origins.named(e), FIELD_NAMES) from None
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


async def list_input_items(
    state: RouterState, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
) -> dict:
    """A stored response's input items, a page of them: newest first by default, as OpenAI lists them."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be 1 to 100, not {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, not {order!r}", param="order")
    items = list((await stored(state, response_id)).get("input", []))
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: {after!r} is no input item of response {response_id}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


async def delete_response(state: RouterState, response_id: str) -> dict:
    if not await forget(state, response_id):
        await stored(state, response_id)  # its 404
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel_response(state: RouterState, response_id: str) -> dict:
    """Only a background response can be cancelled, as OpenAI's: here every response runs in its request."""
    await stored(state, response_id)
    raise APIError(400, "only a background response can be cancelled, and this server runs none", param="response_id")
