"""The request fields that would change what a request means but are not supported: each with the
values that leave the meaning unchanged (what a client sends when it sets them to their defaults).
Such a field at any other value is a 400 naming it (router/http/protocol.py), never ignored."""

from __future__ import annotations

UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": (None, []),  # deprecated upstream for tools
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
    "best_of": (None, 1),  # deprecated upstream; n choices are sampled, never ranked
    # vLLM's
    "use_beam_search": (None, False),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "guided_whitespace_pattern": (None,),
    "prompt_embeds": (None,),
    "kv_transfer_params": (None,),
}
# tools are chat's: a completion has no template to render them nor a message to hold the calls
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    **UNSUPPORTED_FIELDS,
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
}
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    **UNSUPPORTED_FIELDS,
    # OpenAI's
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    # vLLM's
    "chat_template": (None,),
}
REFUSABLE = {**COMPLETION_UNSUPPORTED_FIELDS, **CHAT_UNSUPPORTED_FIELDS}

# the chat API's fields that the Responses and Messages APIs do not have, each with the values that leave a
# request's result unchanged: a client moving from chat may still send them, and such a field at another
# value is a 400 naming it (with the API's own field where it has one), never silently ignored
CHAT_ONLY_FIELDS: dict[str, tuple] = {
    "max_tokens": (None,),
    "max_completion_tokens": (None,),
    "stop": (None, []),
    "n": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
}


def is_neutral(value: object, neutral: tuple) -> bool:
    """Whether value is one of the values that leave a request's meaning unchanged (of the same type:
    `0` is not `False`)."""
    return any(value == v and type(value) is type(v) for v in neutral)


def chat_only_error(field: str, api: str, instead: dict[str, str]) -> str:
    """The message of a chat-only field sent to another API, naming that API's field for it if it has one."""
    own = f" (its field for this is {instead[field]})" if field in instead else ""
    return f"{field} is the chat API's, not a field of the {api}{own}: refused rather than ignored"
