"""The OpenAI API's request and response bodies (the parts this server supports), as pydantic models.
Validation errors become 400 responses with an OpenAI-style body. Types are strict, as OpenAI's are
("stream": "yes" is an error, not true); fields that would change what a request means but are not
supported yet are refused by name rather than ignored; unknown fields that do not (user, metadata)
are ignored."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# fields that change a request's meaning and are not supported: each with the values that leave the
# meaning unchanged (what a client sends when it sets them to their defaults)
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": (None, []),  # deprecated upstream for tools
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
    "best_of": (None, 1),  # deprecated upstream; n choices are sampled, never ranked
}
# tools are chat's: a completion has no template to render them nor a message to hold the calls
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    **UNSUPPORTED_FIELDS,
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
}


def _bad_text(value: Any, where: str) -> str | None:
    """The path of the first string that is not valid Unicode (a lone surrogate such as "\ud800",
    which JSON allows and no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for k, v in value.items():
            if (bad := _bad_text(k, where) or _bad_text(v, f"{where}.{k}" if where else str(k))) is not None:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _bad_text(v, f"{where}.{i}")) is not None:
                return bad
    return None


class APIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    refused: ClassVar[dict[str, tuple]] = UNSUPPORTED_FIELDS

    # declared so that a refusal names its field; never read
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _bad_text(value, "") is not None:
            raise ValueError("holds a string that is not valid Unicode (a lone surrogate)")
        return value

    @field_validator(*COMPLETION_UNSUPPORTED_FIELDS, check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.refused.get(info.field_name)
        if neutral is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise ValueError(
                f"{info.field_name} is not supported by this server"
                + (" for completions (use /v1/chat/completions)" if info.field_name.startswith("tool") else "")
            )
        return value


class JSONSchemaFormat(BaseModel):
    """response_format's json_schema: the output is JSON that validates against `schema`."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type json_schema needs a json_schema object ({"name": ..., "schema": {...}})')
        return self


class SamplingFields(APIRequest):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)  # lower runs first, as vLLM's
    # ranges are checked where SamplingParams is made (router/http/state.py), with the limits of the config
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> bias
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    # structured outputs (router/chat/structured.py): OpenAI's response_format, or one of vLLM's fields
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # a JSON Schema, or its JSON text (checked in router/chat/structured.py)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None  # the output is one of these strings
    guided_grammar: str | None = None  # an EBNF grammar (xgrammar's, with a root rule)

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, tuple]] = COMPLETION_UNSUPPORTED_FIELDS

    tools: Any = None  # declared so that a refusal names them
    tool_choice: Any = None
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None  # the prompt returned before each choice's text (and its logprobs first)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallParam(BaseModel):
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
        except ValueError:
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
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
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's names (and a dot, as vLLM allows)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: the function takes no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (the grammar's, or the first one parsed)
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template ({"enable_thinking": false})
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    echo: bool | None = None  # declared so that a refusal names it: echo is a completions field

    @field_validator("echo")
    @classmethod
    def _echo_is_for_completions(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported by this server for chat completions (use /v1/completions)")
        return value


class TokenizeRequest(APIRequest):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]
