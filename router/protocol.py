"""The OpenAI API's request and response bodies (the parts this server supports), as pydantic models.
Validation errors become 400 responses with an OpenAI-style body. Types are strict, as OpenAI's are
("stream": "yes" is an error, not true); fields that would change what a request means but are not
supported yet are refused by name rather than ignored; unknown fields that do not (user, metadata)
are ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# fields that change a request's meaning and are not supported: each with the values that leave the
# meaning unchanged (what a client sends when it sets them to their defaults)
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "suffix": (None, ""),
    "best_of": (None, 1),  # deprecated upstream; n choices are sampled, never ranked
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
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

    # declared so that a refusal names its field; never read
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    suffix: Any = None
    best_of: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _bad_text(value, "") is not None:
            raise ValueError("holds a string that is not valid Unicode (a lone surrogate)")
        return value

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if not any(value == v and type(value) is type(v) for v in UNSUPPORTED_FIELDS[info.field_name]):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value


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
    priority: int = Field(default=0, ge=-2**63, lt=2**63)  # lower runs first, as vLLM's
    # ranges are checked where SamplingParams is made (router/state.py), with the limits of the config
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> bias
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None

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
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None  # the prompt returned before each choice's text (and its logprobs first)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
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
