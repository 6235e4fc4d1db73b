"""The experts as a torch loop: the reference the fused kernels are checked against, and the path on
the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t, k]: this rank's part of it.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights, ids [T, k]."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return _dense(x, w13, w2, weights, ids)
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the one host sync of the loop
    tokens = order // ids.shape[1]
    flat_weights = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        y = _expert(x.index_select(0, rows), w13[expert], w2[expert])
        out.index_add_(0, rows, y * flat_weights[start : start + count, None])
        start += count
    return out


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    # inside a CUDA graph, where the sparse loop's sync cannot be: every expert over every token, weighted
    # by zero where it was not chosen (E / k times the work)
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        weight = (weights * (ids == expert)).sum(dim=-1, keepdim=True)
        out += _expert(x, w13[expert], w2[expert]) * weight
    return out
