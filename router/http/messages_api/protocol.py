"""Anthropic's Messages API request (the parts this server supports) as pydantic models, strict as the
chat API's; content blocks this server cannot read (images, documents, server tools) are refused by
name where they are translated (router/http/messages_api/translate.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from router.http.protocol import ChatOnlyFields, UnicodeChecked
from router.http.refused import CHAT_ONLY_FIELDS

# the chat API's fields this API has not (max_tokens is its own), and its field for those it names otherwise
CHAT_ONLY = {k: v for k, v in CHAT_ONLY_FIELDS.items() if k != "max_tokens"}
INSTEAD = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


class _Strict(UnicodeChecked):
    model_config = ConfigDict(extra="ignore", strict=True)


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(_Strict):
    type: Literal["custom"] | None = None  # server tools (web_search, ...) have other types
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # the tool's input follows input_schema (a grammar makes it)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    # adaptive: the model decides whether and how long to think, as a thinking model here does once enabled
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)  # the model's thinking is not budgeted here


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, ChatOnlyFields):
    chat_only: ClassVar[dict[str, tuple]] = CHAT_ONLY
    api: ClassVar[str] = "Messages API"
    instead: ClassVar[dict[str, str]] = INSTEAD

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1, le=2**31 - 1)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # the chat API's, as on /v1/responses
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    logit_bias: dict[str, float] | None = None
    # Anthropic's fields that would change the result and that this server does not serve (structured
    # outputs, MCP servers): declared so that each is a 400 naming it, never ignored
    output_format: Any = None
    output_config: Any = None
    mcp_servers: Any = None

    @field_validator("output_format", "output_config", "mcp_servers")
    @classmethod
    def _not_served(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("is not supported by this server")
        return value
