"""A Messages request as the chat request it means: the system prompt a system message, text blocks
content, an assistant's tool_use blocks its tool_calls, tool_result blocks tool messages; a final
assistant turn the text the answer continues (continue_final_message); tool_choice any the chat API's
"required"; thinking, when not enabled, the template's enable_thinking false."""

from __future__ import annotations

import json

from router.http.chat_bridge import Origins, chat_request
from router.http.errors import APIError
from router.http.messages import joined_parts
from router.http.messages_api.protocol import CountTokensRequest, MessagesRequest, ToolChoice
from router.http.protocol import ChatCompletionRequest


def _text(blocks: object, field: str) -> str:
    """Text blocks' text (a tool_result's content, a system prompt), or a 400 naming the block."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{field}: must be a string or a list of text blocks", param=field)
    out = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise APIError(400, f"{field}.{i}: must be a content block (an object with a type)", param=f"{field}.{i}")
        if block.get("type") != "text":
            raise _unsupported(block, f"{field}.{i}")
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{field}.{i}: a text block needs its text", param=f"{field}.{i}.text")
        out.append(block["text"])
    return joined_parts(out)


def _unsupported(block: dict, where: str) -> APIError:
    kind = block.get("type")
    return APIError(400, f"{where}: {kind!r} content blocks are not supported by this server", param=f"{where}.type")


def _user(content: list[dict], where: str, calls: set[str]) -> list[dict]:
    """A user turn's messages: its tool results (each answering one of `calls`, the tool_use ids of the
    assistant turn before it), then its text."""
    tools, text = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str) and block["tool_use_id"]:
            if block["tool_use_id"] not in calls:
                raise APIError(
                    400,
                    f"{at}.tool_use_id: {block['tool_use_id']!r} answers no tool_use block of the assistant "
                    "message before it",
                    param=f"{at}.tool_use_id",
                )
            result = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:  # chat templates have no field for it: the result says so
                result = f"Error: {result}"
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in ("text", "tool_result"):
            raise APIError(
                400, f"{at}: a {kind} block needs its {'text' if kind == 'text' else 'tool_use_id'}", param=at
            )
        else:
            raise _unsupported(block, at)
    return tools + ([{"role": "user", "content": joined_parts(text)}] if text else [])


_TOOL_USE_FIELDS = (("id", str), ("name", str), ("input", dict))


def _assistant(content: list[dict], where: str) -> dict:
    text, calls = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and all(isinstance(block.get(k), t) and block[k] != "" for k, t in _TOOL_USE_FIELDS):
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thinking stays out of the prompt, as chat templates leave it
        elif kind in ("text", "tool_use"):
            raise APIError(400, f"{at}: a {kind} block is missing its fields", param=at)
        else:
            raise _unsupported(block, at)
    message = {"role": "assistant", "content": joined_parts(text) or None}
    return {**message, "tool_calls": calls} if calls else message


def chat_messages(req: CountTokensRequest, origins: Origins | None = None) -> list[dict]:
    """The request's messages as chat's; `origins` gets the field each came from."""
    origins = Origins() if origins is None else origins
    system = "" if req.system is None else _text(req.system, "system")
    # an empty system prompt ([] or "") is none: a template would render an empty system turn for it
    messages = [{"role": "system", "content": system}] if system else []
    if system:
        origins.add("system")
    calls: set[str] = set()  # the tool_use ids of the assistant turn before, which its results answer
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if not m.content and not (m.role == "assistant" and i == len(req.messages) - 1):
            raise APIError(400, f"{where}.content: a message needs content", param=f"{where}.content")
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            origins.add(where)
        elif m.role == "user":
            turn = _user(m.content, where, calls)
            messages += turn
            for _ in turn:
                origins.add(where)
        else:
            messages.append(_assistant(m.content, where))
            uses = [j for j, b in enumerate(m.content) if b.get("type") == "tool_use"]
            origins.add(where, calls_at=f"{where}.content.{uses[0]}" if uses else None)
        calls = {c["id"] for c in messages[-1].get("tool_calls", ())} if m.role == "assistant" else set()
    return messages


_PREFILL_BLOCKS = ("text", "thinking", "redacted_thinking")  # thinking is left out of the prompt, as ever


def prefilled(req: CountTokensRequest) -> bool:
    """Whether the conversation ends with an assistant turn, which the answer continues (a prefill)."""
    last = req.messages[-1]
    if last.role != "assistant":
        return False
    if isinstance(last.content, list) and any(b.get("type") not in _PREFILL_BLOCKS for b in last.content):
        raise APIError(
            400,
            f"messages.{len(req.messages) - 1}.content: a final assistant message the answer continues may hold "
            "only text",
            param=f"messages.{len(req.messages) - 1}.content",
        )
    if isinstance(last.content, str):
        text = last.content
    else:  # as the prompt renders the blocks (_assistant)
        text = joined_parts(
            [b["text"] for b in last.content if b.get("type") == "text" and isinstance(b.get("text"), str)]
        )
    if text and text != text.rstrip():
        # as Anthropic's API: the answer's first token would otherwise follow a space the tokenizer never
        # saw there (a word's piece carries its own)
        raise APIError(
            400,
            f"messages.{len(req.messages) - 1}.content: final assistant content cannot end with trailing whitespace",
            param=f"messages.{len(req.messages) - 1}.content",
        )
    return True


def _tool_choice(choice: ToolChoice | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice: type tool needs the name of the tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_of(req: CountTokensRequest, origins: Origins | None = None) -> ChatCompletionRequest:
    """The chat request `req` means; `origins` gets the field each of its messages came from."""
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                400, f"tools.{i}.type: {tool.type!r} tools are not supported by this server", param=f"tools.{i}.type"
            )
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
                "strict": t.strict,
            },
        }
        for t in req.tools or []
    ] or None
    thinking = req.thinking is not None and req.thinking.type in ("enabled", "adaptive")
    choice = req.tool_choice
    messages, prefill = chat_messages(req, origins), prefilled(req)
    if prefill and not messages[-1]["content"]:  # an empty final assistant turn prefills nothing
        messages, prefill = messages[:-1], False
        if not any(m["role"] != "system" for m in messages):
            raise APIError(
                400,
                "messages: a final assistant message with empty content prefills nothing, and no message is "
                "left before it to answer",
                param="messages",
            )
    fields = {
        "model": req.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
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
            "seed": req.seed,
            "logit_bias": req.logit_bias,
            "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
    return chat_request(fields)
