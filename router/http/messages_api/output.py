"""Anthropic's shapes of a chat result: a message's content blocks (thinking, text, tool_use), its
stop_reason (end_turn, max_tokens, stop_sequence with the sequence, tool_use) and errors."""

from __future__ import annotations

import uuid

from fastapi.responses import JSONResponse, Response

from router.chat.output import IN_ORDER
from router.chat.tool_calls import json_text, parse_arguments
from router.http.errors import APIError, anthropic_error


def error_response(error: APIError) -> JSONResponse:
    return anthropic_error(error.status, error.message)


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: dict) -> str:
    """A chat call's id with Anthropic's prefix (ids are opaque either way)."""
    return "toolu_" + call["id"].removeprefix("call_")


def tool_use(call: dict) -> dict:
    """The call's block, its input's numbers as the model wrote them (one past a double's range, which a
    schema's grammar allows, is no float: json_response writes it back as written)."""
    return {
        "type": "tool_use",
        "id": tool_use_id(call),
        "name": call["function"]["name"],
        "input": parse_arguments(call["function"]["arguments"]),
    }


def blocks_of(message: dict) -> list[dict]:
    """A whole chat message's content blocks, as its stream gives them: the thinking, then a text block for
    each run of text and a tool_use block for each call, in the order the model wrote them (one text block,
    perhaps empty, when there is nothing else)."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    calls = message.get("tool_calls") or []
    for segment in message[IN_ORDER]:
        blocks.append({"type": "text", "text": segment} if isinstance(segment, str) else tool_use(calls[segment]))
    return blocks or [{"type": "text", "text": ""}]


def json_response(body: dict) -> Response:
    """A whole message as JSON, its tool inputs' numbers as written."""
    return Response(json_text(body), media_type="application/json")


def stop_of(
    finish_reason: str | None, token_ids: list[int], eos_ids, stops: list[str], tokenizer
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A chat "stop" is end_turn when the last token ends the text, else a
    stop sequence: the first in the output's text, where the detokenizer cut it."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if stops and token_ids and token_ids[-1] not in eos_ids:
        text = tokenizer.decode(token_ids)
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: `input_tokens` counts the prompt tokens computed, `cache_read_input_tokens` those
    the prefix cache served (their sum is the prompt)."""
    return {
        "input_tokens": input_tokens - cached_tokens,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def message_body(
    message_id: str, model: str, blocks: list[dict], stop: tuple[str | None, str | None], used: dict
) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": used,
    }
