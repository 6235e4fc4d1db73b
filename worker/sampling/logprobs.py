"""Logprobs on the device: of each row's sampled token (over the raw logits, before any processor or
filter, as vLLM reports them by default), and of prompt tokens, scored from the prefill's hidden states."""

from __future__ import annotations

from collections.abc import Callable

import torch

# prompt positions projected to the vocabulary at once: a 152k vocabulary makes each row 0.6 MB of float32
_PROMPT_CHUNK = 512


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """float32 [B] logprob of each row's token, and with k > 0 the k most likely: (values, int32 ids)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)
    if k <= 0:
        return chosen, None, None
    values, ids = logp.topk(k, dim=-1)
    return chosen, values, ids.to(torch.int32)


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    idx: torch.Tensor,
    target: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The logprob of target[i] after the token idx[i] of the step (hidden [T, H]), and with k > 0 the k
    most likely there; in chunks, so that memory stays bounded for long prompts."""
    parts = []
    for start in range(0, len(idx), _PROMPT_CHUNK):
        rows = idx[start : start + _PROMPT_CHUNK]
        # every rank runs the same chunks: compute_logits gathers the vocabulary across ranks
        parts.append(token_logprobs(compute_logits(hidden[rows]), target[start : start + _PROMPT_CHUNK], k))
    chosen = torch.cat([p[0] for p in parts])
    if k <= 0:
        return chosen, None, None
    return chosen, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
