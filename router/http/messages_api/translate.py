"""A Messages request as the chat request it means: the system prompt a system message, text blocks
content, an assistant's tool_use blocks its tool_calls, tool_result blocks tool messages; tool_choice
any the chat API's "required"; thinking, when not enabled, the template's enable_thinking false."""

from __future__ import annotations

import json

from router.http.chat_bridge import chat_request
from router.http.errors import APIError
from router.http.messages_api.protocol import CountTokensRequest, MessagesRequest, ToolChoice
from router.http.protocol import ChatCompletionRequest


def _text(blocks: str | list[dict], field: str) -> str:
    """Text blocks' text (a tool_result's content, a system prompt), or a 400 naming the block."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _unsupported(block, f"{field}.{i}")
        out.append(block["text"])
    return "".join(out)


def _unsupported(block: dict, where: str) -> APIError:
    kind = block.get("type")
    return APIError(400, f"{where}: {kind!r} content blocks are not supported by this server", param=f"{where}.type")


def _user(content: list[dict], where: str) -> list[dict]:
    tools, text = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = _text(block.get("content", ""), f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in ("text", "tool_result"):
            raise APIError(
                400, f"{at}: a {kind} block needs its {'text' if kind == 'text' else 'tool_use_id'}", param=at
            )
        else:
            raise _unsupported(block, at)
    return tools + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(content: list[dict], where: str) -> dict:
    text, calls = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thinking stays out of the prompt, as chat templates leave it
        elif kind in ("text", "tool_use"):
            raise APIError(400, f"{at}: a {kind} block is missing its fields", param=at)
        else:
            raise _unsupported(block, at)
    message = {"role": "assistant", "content": "".join(text) or None}
    return {**message, "tool_calls": calls} if calls else message


def chat_messages(req: CountTokensRequest) -> list[dict]:
    messages = [] if req.system is None else [{"role": "system", "content": _text(req.system, "system")}]
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(m.content, f"messages.{i}")
        else:
            messages.append(_assistant(m.content, f"messages.{i}"))
    return messages


def _tool_choice(choice: ToolChoice | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice: type tool needs the name of the tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_of(req: CountTokensRequest) -> ChatCompletionRequest:
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                400, f"tools.{i}.type: {tool.type!r} tools are not supported by this server", param=f"tools.{i}.type"
            )
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in req.tools or []
    ] or None
    thinking = req.thinking is not None and req.thinking.type == "enabled"
    choice = req.tool_choice
    fields = {
        "model": req.model,
        "messages": chat_messages(req),
        "tools": [{**t, "function": {k: v for k, v in t["function"].items() if v is not None}} for t in tools or []]
        or None,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
        "chat_template_kwargs": None if thinking else {"enable_thinking": False},
    }
    if isinstance(req, MessagesRequest):
        fields |= {
            "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences or None,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "logit_bias": req.logit_bias,
            "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
    return chat_request(fields)
