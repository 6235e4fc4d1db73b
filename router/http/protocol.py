"""The OpenAI API's request and response bodies (the parts this server supports), as pydantic models.
Validation errors become 400 responses with an OpenAI-style body. Types are strict, as OpenAI's are
("stream": "yes" is an error, not true); fields that would change what a request means but are not
supported yet are refused by name rather than ignored; unknown fields that do not (user, metadata)
are ignored, but a key that nearly names a field (max_token) is refused (router/http/known_fields.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from router.http.known_fields import KnownFields
from router.http.messages import ChatMessage
from router.http.refused import (
    CHAT_ONLY_FIELDS,
    CHAT_UNSUPPORTED_FIELDS,
    COMPLETION_UNSUPPORTED_FIELDS,
    REFUSABLE,
    UNSUPPORTED_FIELDS,
    chat_only_error,
    is_neutral,
)

# values that hold no string: a list of them (a prompt's token ids) is passed over by type alone
_SCALARS = frozenset((int, float, bool, type(None)))


def _holds_bad_text(value: Any) -> bool:
    """Whether value holds a string that is not valid Unicode (a lone surrogate such as "\ud800", which
    JSON allows and no tokenizer can encode). A list of token ids is checked by the types it holds, in C:
    a walk element by element cost 0.2 ms a request for a prompt of 1,024 ids."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
    elif isinstance(value, dict):
        return any(_holds_bad_text(k) or _holds_bad_text(v) for k, v in value.items())
    elif isinstance(value, list):
        return not _SCALARS.issuperset(map(type, value)) and any(map(_holds_bad_text, value))
    return False


class UnicodeChecked(KnownFields):
    """A request model (of every API) whose fields hold no string that is not valid Unicode: a 400
    naming the field, where a tokenizer would fail later; and no NaN or infinity (JSON has neither,
    Python's parser reads both), refused as such rather than as out of a field's range."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        try:
            bad = _holds_bad_text(value)
        except RecursionError:  # JSON parses deeper than Python recurses: no field here needs such depth
            raise ValueError("is nested too deeply") from None
        if bad:
            raise ValueError("holds a string that is not valid Unicode (a lone surrogate)")
        return value


class ChatOnlyFields(UnicodeChecked):
    """The chat API's sampling fields, declared on an API that lacks them (Responses, Messages): a client
    moving from chat that still sends one at a value that would change the result gets a 400 naming it,
    not an answer that ignored it. `chat_only`: those the API lacks (others it may declare as its own);
    `api`: its name; `instead`: its own field for each it names otherwise."""

    chat_only: ClassVar[dict[str, tuple]] = {}
    api: ClassVar[str] = ""
    instead: ClassVar[dict[str, str]] = {}

    max_tokens: Any = None
    max_completion_tokens: Any = None
    stop: Any = None
    n: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None

    @field_validator(*CHAT_ONLY_FIELDS)
    @classmethod
    def _chat_only(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.chat_only.get(info.field_name)
        if neutral is not None and not is_neutral(value, neutral):
            raise ValueError(chat_only_error(info.field_name, cls.api, cls.instead))
        return value


class APIRequest(UnicodeChecked):
    model_config = ConfigDict(extra="ignore", strict=True)
    refused: ClassVar[dict[str, tuple]] = UNSUPPORTED_FIELDS

    # declared so that a refusal names its field; never read
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    guided_whitespace_pattern: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None

    @field_validator(*REFUSABLE, check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.refused.get(info.field_name)
        if neutral is not None and not is_neutral(value, neutral):
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
    # an extension, as structured_outputs' field: false lets whitespace between JSON tokens be free
    disable_any_whitespace: bool | None = None  # None: the server's default (compact JSON)

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type json_schema needs a json_schema object ({"name": ..., "schema": {...}})')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one constraint on the whole output (router/chat/structured.py). Its keys
    are vLLM's alone: a misspelled one is a 400 (ignored, it would leave the output unconstrained)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    refused: ClassVar[dict[str, tuple]] = {
        "structural_tag": (None,),
        "whitespace_pattern": (None,),
        "disable_additional_properties": (None, False),
    }
    CONSTRAINTS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    json_: Any = Field(default=None, alias="json")  # a JSON Schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: the server's default (true: compact JSON)
    disable_fallback: bool | None = None  # one backend here, so nothing to fall back from
    # declared so that a refusal names them
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_additional_properties: Any = None

    @field_validator("structural_tag", "whitespace_pattern", "disable_additional_properties")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if not is_neutral(value, cls.refused[info.field_name]):
            raise ValueError(f"structured_outputs.{info.field_name} is not supported by this server")
        return value

    def given(self) -> list[str]:
        """The constraints set, in vLLM's names (json_object: false sets none)."""
        return [name for name in self.CONSTRAINTS if getattr(self, _attr(name)) not in (None, False)]

    def value(self, name: str) -> Any:
        return getattr(self, _attr(name))


def _attr(name: str) -> str:
    return "json_" if name == "json" else name


class StreamOptions(BaseModel):
    """stream_options, typed: a string "false" is a 400, not a true value."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(APIRequest):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # the sampler's int32; >= vocab: off
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # any 64-bit integer, as vLLM's (-1 included)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)  # lower runs first, as vLLM's
    # accepted and ignored (they do not change the output), but typed as OpenAI's: a wrong type is a 400
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # ranges are checked where SamplingParams is made (router/http/state.py), with the limits of the config
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> bias
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs (router/chat/structured.py): OpenAI's response_format, or one of vLLM's fields
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # a JSON Schema, or its JSON text (checked in router/chat/structured.py)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None  # the output is one of these strings
    guided_grammar: str | None = None  # an EBNF grammar (xgrammar's, with a root rule)
    structured_outputs: StructuredOutputs | None = None  # vLLM's successor of the guided_* fields
    # vLLM's: k most likely per prompt token (router/http/extras.py writes them)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k; -1: the context
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words the output never ends with (cluster/scheduler/token_set.py)
    include_stop_str_in_output: bool | None = None  # the stop string (or stop token) that ended it stays in the text
    add_special_tokens: bool | None = None  # None: completions add them, chat does not (the template does)

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
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


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # OpenAI's characters (and a dot, as vLLM allows); up to 128 of them, as Anthropic's tool names, which
    # /v1/messages serves as these (OpenAI's own stop at 64, vLLM's are unbounded)
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,128}$")
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
    refused: ClassVar[dict[str, tuple]] = CHAT_UNSUPPORTED_FIELDS

    # declared so that a refusal names them
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    chat_template: Any = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (the grammar's, or the first one parsed)
    include_reasoning: bool | None = None  # vLLM's; False: the reasoning is parsed out and not returned
    # vLLM's: documents for the chat template to render (a retrieval-augmented template's); each a dict of
    # strings, as transformers' apply_chat_template takes them
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template ({"enable_thinking": false})
    # vLLM's: the assistant turn's opening after the messages, or (continue_final_message) none, the answer
    # continuing the last message as it stands (a prefill)
    add_generation_prompt: bool | None = None  # None: true
    continue_final_message: bool | None = None  # None: false
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    echo: bool | None = None  # declared so that a refusal names it: echo is a completions field

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # OpenAI's and vLLM's 400, rather than none returned
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("echo")
    @classmethod
    def _echo_is_for_completions(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported by this server for chat completions (use /v1/completions)")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continues_without_a_new_turn(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("add_generation_prompt") is not False:  # vLLM's 400: the two contradict
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return value


class TokenizeRequest(APIRequest):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template first, with what else
    the chat route renders them with (tools, chat_template_kwargs), so the count is chat's."""

    # the fields a chat request takes from this one: every one that changes its prompt
    CHAT_FIELDS: ClassVar[tuple[str, ...]] = (
        "messages",
        "tools",
        "chat_template_kwargs",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool | None = None  # None: a prompt's are added, messages' are the template's alone
    add_generation_prompt: bool | None = None  # None: true
    continue_final_message: bool | None = None  # None: false

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]
