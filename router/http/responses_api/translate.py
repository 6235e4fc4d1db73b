"""A Responses request as the chat request it means: instructions and input items become messages
(function_call items an assistant's tool_calls, function_call_output items tool messages), text.format
the response_format, reasoning.effort "none" the template's enable_thinking false."""

from __future__ import annotations

from pydantic import ValidationError

from router.http.chat_bridge import Origins, chat_request
from router.http.errors import APIError, validation_error
from router.http.protocol import ChatCompletionRequest
from router.http.responses_api.protocol import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
)


def input_messages(
    items: str | list[dict], history: list[dict] = (), field: str = "input", origins: Origins | None = None
) -> list[dict]:
    """The input as chat messages, after `history` (the conversation of previous_response_id), or a 400
    naming the item at fault; a function_call_output answers a function_call of either. `origins` gets the
    item each message came from."""
    origins = Origins() if origins is None else origins
    if isinstance(items, str):
        origins.add(field)
        return [{"role": "user", "content": items}]
    calls = {c["id"] for m in history for c in m.get("tool_calls", ())}
    messages: list[dict] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message")  # an "easy" message has only role and content
        model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None  # a list or an object names none
        if model is None:
            raise APIError(
                400,
                f"{field}.{i}.type: {kind!r} items are not supported by this server "
                f"(it takes {', '.join(INPUT_ITEMS)})",
                param=f"{field}.{i}.type",
            )
        try:
            item = model.model_validate(raw)
        except ValidationError as e:
            where, msg = validation_error(e.errors(), raw, (field, i))
            raise APIError(400, f"{where}: {msg}", param=where) from e
        at = f"{field}.{i}"
        last = messages[-1] if messages else None
        after_assistant = last is not None and last["role"] == "assistant"
        if isinstance(item, MessageItem) and item.role == "assistant" and after_assistant:
            # one turn's output items as it was written: text, a call, more text (a response's own output
            # sent back) are one assistant message, its text joined
            last["content"] = (last["content"] or "") + item.text()
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
            origins.add(at)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            calls.add(item.call_id)
            if after_assistant:  # calls of one turn are one message's
                last.setdefault("tool_calls", []).append(call)
                origins.calls.setdefault(len(origins.of) - 1, at)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.add(at, calls_at=at)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:  # OpenAI's 400 too: a result must answer a call before it
                raise APIError(
                    400,
                    f"{field}.{i}.call_id: no function_call before it has the call_id {item.call_id!r}",
                    param=f"{field}.{i}.call_id",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            origins.add(at)
    return messages


def chat_of(req: ResponsesRequest, messages: list[dict], origins: Origins | None = None) -> ChatCompletionRequest:
    """The chat request of these messages: the input's, after those of the responses before it
    (previous_response_id); `origins`, theirs, gets the instructions'."""
    if req.instructions:  # first (an empty one is none); not carried over from a previous response, as OpenAI's
        messages = [{"role": "system", "content": req.instructions}, *messages]
        if origins is not None:
            origins.prepend("instructions")
    if not messages:
        raise APIError(400, "input: the conversation is empty", param="input")
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools or []
    ] or None
    effort = req.reasoning.effort if req.reasoning is not None else None
    return chat_request(
        {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "logit_bias": req.logit_bias,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req),
            "chat_template_kwargs": {"enable_thinking": False} if effort == "none" else None,
            "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
    )


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format: type json_schema needs a schema", param="text.format.schema")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
