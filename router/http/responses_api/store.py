"""Stored responses as the Responses API uses them: what a response is kept as (its body for GET, and
its conversation so far, for a later request's previous_response_id), in the tier's store actor."""

from __future__ import annotations

import json

from router.http.errors import APIError
from router.http.responses_api.output import new_id
from router.http.state import RouterState
from router.tier.response_store import response_store


def _store(state: RouterState):
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = response_store(state.config.port)
    return store


def assistant_message(output: list[dict]) -> dict:
    """A response's output as the assistant turn a continued conversation renders."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(given: str | list[dict]) -> list[dict]:
    """A request's input as the items GET /v1/responses/{id}/input_items lists: each with an id, a
    message's content as parts (a string is one input_text part, an assistant's one output_text part)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for raw in given:
        item = {"type": "message", **raw} if "type" not in raw else dict(raw)
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", new_id(_ID_PREFIXES.get(item["type"], "item")))
        items.append(item)
    return items


async def keep(state: RouterState, body: dict, messages: list[dict], given: list[dict] | None = None) -> None:
    """Stores a finished response, before the client hears of it: a GET or a previous_response_id
    that follows at once, through any router of the tier, finds it. `given`: its input items."""
    record = {"response": body, "messages": [*messages, assistant_message(body["output"])], "input": given or []}
    await _store(state).put.remote(body["id"], record, len(json.dumps(record)))


async def stored(state: RouterState, response_id: str, field: str | None = None) -> dict:
    """A stored response's record, or a 404 (naming `field` when a request named it)."""
    record = await _store(state).get.remote(response_id)
    if record is None:
        raise APIError(
            404,
            f"no stored response has the id {response_id!r} (it was never stored, was deleted, or expired)",
            "not_found_error",
            param=field,
        )
    return record


async def forget(state: RouterState, response_id: str) -> bool:
    return await _store(state).delete.remote(response_id)
