"""Batched sampling on the device: greedy, temperature, top-k and top-p.

Randomness comes from a hash of (request seed, position), not from a generator's state, so a seeded
request samples the same tokens whatever else is in its batch, on any device, and every
tensor-parallel rank (holding the same logits) samples the same token without a broadcast."""

from __future__ import annotations

import torch

from worker import triton_ops

_MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # an integer finalizer with multipliers below 2**31, so int64 products never overflow
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x6C8E9CF5) & _MASK32
    return h ^ (h >> 16)


def uniform_from(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row, a pure function of (seed, position)."""
    h = _mix32(seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32 ^ 0x5BD1E995)
    h = _mix32(h ^ _mix32(positions & _MASK32))
    return (h.double() + 0.5) / 2.0**32


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, *, all_greedy: bool, any_filter: bool) -> torch.Tensor:
    """logits: float32 [B, V]. `all_greedy` and `any_filter` are known on the host and skip work."""
    if all_greedy:
        return logits.argmax(dim=-1)
    if not any_filter and triton_ops.available(logits):  # one kernel for what follows
        return triton_ops.sample_rows(logits, temperature, uniform_from(seeds, positions))
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature.clamp(min=1e-5).unsqueeze(1), dim=-1)
    order = None
    if any_filter:
        probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
        rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        keep = (rank < k) & ((before < top_p.unsqueeze(1)) | (rank == 0))
        probs = probs * keep
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = (uniform_from(seeds, positions).unsqueeze(1) * total.double()).to(cdf.dtype)
    # strictly below the total, so the search lands on a token with probability, never past the end
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    if order is not None:
        idx = order.gather(1, idx.unsqueeze(1)).squeeze(1)
    return torch.where(temperature <= 0, greedy, idx)
