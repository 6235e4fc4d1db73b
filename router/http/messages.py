"""The chat API's messages as pydantic models: what a conversation sends (text, earlier tool calls and
their results), and how a Hugging Face chat template reads it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, model_validator

from router.http.known_fields import KnownFields


class ContentPartError(ValueError):
    """A message's content part this server cannot take: `index` in the content list, `field` of the part."""

    def __init__(self, index: int, field: str, problem: str) -> None:
        super().__init__(problem)
        self.index, self.field = index, field


def joined_parts(texts: list[str]) -> str:
    """One message's text parts (chat's content parts, Responses' input_text parts, Anthropic's text
    blocks) as the one string a chat template renders: a newline between two, as vLLM joins them (glued,
    "Hello" and "world" would read "Helloworld")."""
    return "\n".join(texts)


class FunctionCall(KnownFields):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallParam(KnownFields):
    """A tool call of an earlier assistant message, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As Hugging Face chat templates read a call: arguments as a mapping (Llama's template writes
        them with tojson; Qwen's takes a mapping or a string)."""
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser recurses
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(KnownFields):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def for_template(self) -> dict:
        """The message as Hugging Face chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise ContentPartError(j, "type", f"is {part.get('type')!r}: only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise ContentPartError(j, "text", "must be a string")
            parts.append(part["text"])
        return joined_parts(parts)
