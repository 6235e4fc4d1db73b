"""Top-k routing: each token's experts and their weights from the router's logits, on the device."""

from __future__ import annotations

import torch


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] in logits' dtype, expert ids [T, top_k] int64).

    Softmax over all experts in float32, then the top k; `renormalize` (Qwen's norm_topk_prob, always on
    for Mixtral) rescales the k weights to sum to one, which equals a softmax over the selected logits."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids
