"""A completion's prompts as OpenAI's API allows them: one string, one token-id list, or a list of
either (lm-evaluation-harness sends a batch so), each tokenized and checked here, so that a bad one
is a 400 for the whole request before any prompt runs; and vLLM's truncate_prompt_tokens."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from router.http.errors import APIError
from router.http.protocol import CompletionRequest, SamplingFields


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    # as an echo returns it: the client's text, or its token ids decoded; None when the request does not
    # echo (decoding a long prompt of ids costs the first token a share of a millisecond)
    text: str | None


# a completion's max_tokens when it sets none, as OpenAI's
COMPLETION_MAX_TOKENS = 16


def _several(prompt: str | list) -> bool:
    """Whether `prompt` lists prompts (strings or lists of ids), not one string or one list of ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def prompt_count(prompt: str | list) -> int:
    """How many prompts a completions request's `prompt` lists (a string or one list of ids is one)."""
    return len(prompt) if _several(prompt) else 1


def completion_prompts(
    req: CompletionRequest, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_seq_len: int
) -> list[Prompt]:
    """The request's prompts in order, truncated as it asks."""
    prompt = req.prompt
    several = _several(prompt)
    prompts = prompt if several else [prompt]
    special = req.add_special_tokens is not False
    out = []
    for i, one in enumerate(prompts):
        where = f"prompt {i}: " if several else ""
        if isinstance(one, str):
            ids = tokenizer(one, add_special_tokens=special).input_ids
        else:
            bad = [t for t in one if not 0 <= t < vocab_size]
            if bad:
                raise APIError(
                    400, f"{where}token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="prompt"
                )
            ids = list(one)
        kept = truncated(ids, req, max_seq_len, req.max_tokens or COMPLETION_MAX_TOKENS)
        if not req.echo:
            text = None
        elif isinstance(one, str) and len(kept) == len(ids):
            text = one
        else:
            text = tokenizer.decode(kept)
        out.append(Prompt(kept, text))
    return out


def truncated(ids: list[int], req: SamplingFields, max_seq_len: int, max_tokens: int | None = None) -> list[int]:
    """The last truncate_prompt_tokens of ids (vLLM's left truncation). -1 keeps what leaves `max_tokens` (the
    request's, or one token when it sets none) room in the model's context: a prompt cut to the whole context
    could never run."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0 or k > max_seq_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens is {k}; it keeps the prompt's last k tokens, k from 1 to this model's "
            f"context of {max_seq_len} tokens, or -1: as many as leave max_tokens room",
            param="truncate_prompt_tokens",
        )
    if k == -1:
        k = max(max_seq_len - (max_tokens or 1), 1)
    if len(ids) > k >= max_seq_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens is {k}: the prompt cut to it fills this model's context of {max_seq_len} "
            "tokens, leaving none to generate; lower it, or use -1",
            param="truncate_prompt_tokens",
        )
    return ids[-k:] if len(ids) > k else ids
