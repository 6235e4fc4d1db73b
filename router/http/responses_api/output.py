"""Response objects of the Responses API: the output items a chat choice's parts become (reasoning,
then the message, then one function_call per tool call), the usage, and the response around them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from router.chat.output import IN_ORDER
from router.http.responses_api.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [reasoning_text(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
    }


def items_of(message: dict, status: str) -> list[dict]:
    """A whole chat message's output items, as its stream gives them: the reasoning, then a message item for
    each run of text and a function_call for each call, in the order the model wrote them (a message a call
    follows is completed; the last item, a message, has the response's status); a message item, empty, where
    there is neither, so that output_text is always there to read."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    for segment in message[IN_ORDER]:
        if isinstance(segment, str):
            items.append(message_item(new_id("msg"), segment))
        else:
            items.append(function_call_item(new_id("fc"), calls[segment]))
    if items and items[-1]["type"] == "message":
        items[-1]["status"] = status
    if not any(item["type"] in ("message", "function_call") for item in items):
        items.append(message_item(new_id("msg"), "", status))
    return items


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int, cached_tokens: int = 0) -> dict:
    """`reasoning_tokens` counts the reasoning text tokenized again, which may count more than were generated
    (a character cut between two tokens decodes to replacement characters, several tokens each): at most
    the output's."""
    reasoning_tokens = min(reasoning_tokens, output_tokens)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


@dataclass
class ResponseHead:
    """What a response says of its request, the same in every event of its stream."""

    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        incomplete: str | None = None,
        error: dict | None = None,
    ) -> dict:
        req = self.req
        fmt = req.text.format if req.text else None
        if fmt is not None:  # a name (and a schema) are json_schema's alone
            only = None if fmt.type == "json_schema" else {"type"}
            fmt = fmt.model_dump(by_alias=True, exclude_none=True, include=only)
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": req.reasoning.summary if req.reasoning else None,
            },
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def failure_code(error: dict) -> str:
    """The Responses API's error code for a chat stream's error event, by its type: the request's fault,
    the rate limit's, or the server's (a timeout, a replica gone, an engine failure)."""
    return {"invalid_request_error": "invalid_prompt", "rate_limit_error": "rate_limit_exceeded"}.get(
        error.get("type"), "server_error"
    )


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """A response's status and incomplete reason from its choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None
