"""vLLM's additions to a response, asked for by its request: the prompt's and each choice's token ids
(return_token_ids), logprob tokens written as their ids (return_tokens_as_token_ids), each prompt
token's logprobs (prompt_logprobs) and usage on every stream chunk (stream_options'
continuous_usage_stats)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.replicas.generation import PromptLogprobs


@dataclass(frozen=True)
class Extras:
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    prompt_logprobs: int | None = None  # k: the k most likely per prompt token
    continuous_usage: bool = False
    skip_special_tokens: bool = True  # what the text leaves out, which text_offset then counts nothing for

    @property
    def in_stream(self) -> bool:
        """Whether stream chunks carry more than OpenAI's fields."""
        return self.return_token_ids or self.continuous_usage or self.tokens_as_ids


def prompt_logprobs_list(
    prompt: list[int], scored: PromptLogprobs | None, k: int, token: Callable[[int], str]
) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first (nothing comes before it), then
    {token id: {logprob, rank, decoded_token}} of the token itself and the k most likely there. A rank
    is known for the k most likely; the prompt token's is null when it is not among them."""
    out: list[dict | None] = [None]
    for position, (logprob, top) in zip(prompt[1:], scored or []):
        top = top[:k]
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        entry = {str(position): {"logprob": logprob, "rank": ranks.get(position), "decoded_token": token(position)}}
        for t, v in top:
            entry.setdefault(str(t), {"logprob": v, "rank": ranks[t], "decoded_token": token(t)})
        out.append(entry)
    return out + [None] * (len(prompt) - len(out))
