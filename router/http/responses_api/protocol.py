"""OpenAI's Responses API request (the parts this server supports) as pydantic models: strict types as
the chat API's; fields that would change what a request means and are not supported are refused by
name; the rest that do not (metadata, user, service_tier) are ignored."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from router.http.messages import joined_parts
from router.http.protocol import ChatOnlyFields, UnicodeChecked
from router.http.refused import CHAT_ONLY_FIELDS, is_neutral

# field -> the values that leave a request's meaning unchanged (what a client sends as the default)
REFUSED: dict[str, tuple] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
}
# the chat API's fields this API has not (top_logprobs is refused above): the Responses field for each one
# it has another name for
CHAT_ONLY = {k: v for k, v in CHAT_ONLY_FIELDS.items() if k not in REFUSED}
INSTEAD = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class _Strict(UnicodeChecked):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class InputText(_Strict):
    """A text part of an input message (input_text; output_text in an assistant's earlier turn)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else joined_parts([p.text for p in self.content])


class FunctionCallItem(_Strict):
    """An earlier turn's tool call, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The result of a function_call, by its call_id."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else joined_parts([p.text for p in self.output])


class ReasoningItem(_Strict):
    """An earlier turn's reasoning: chat templates leave it out of later turns' prompts, and so does this."""

    type: Literal["reasoning"]


INPUT_ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model's own: a different one is refused by its type


class ReasoningConfig(_Strict):
    # "none" turns the model's thinking off (the template's enable_thinking); others leave it on
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the reasoning is returned whole


class ResponsesRequest(_Strict, ChatOnlyFields):
    refused: ClassVar[dict[str, tuple]] = REFUSED
    chat_only: ClassVar[dict[str, tuple]] = CHAT_ONLY
    api: ClassVar[str] = "Responses API"
    instead: ClassVar[dict[str, str]] = INSTEAD

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None  # nothing extra is ever included (no encrypted reasoning here)
    metadata: dict[str, str] | None = None
    user: str | None = None
    # the chat API's, as vLLM's Responses API takes them (checked where the chat request is)
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    # declared so that a refusal names them
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None

    @field_validator(*REFUSED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if not is_neutral(value, cls.refused[info.field_name]):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a response's request, counted, not run (its model may be left out)."""

    model: str | None = None
