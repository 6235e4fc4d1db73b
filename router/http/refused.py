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
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
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
    "documents": (None, []),
    "include_reasoning": (None, True),
}
REFUSABLE = {**COMPLETION_UNSUPPORTED_FIELDS, **CHAT_UNSUPPORTED_FIELDS}
