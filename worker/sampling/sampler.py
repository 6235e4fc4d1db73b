"""Batched sampling on the device: greedy, temperature, top-k and top-p.

A sampled row draws the token that maximizes logit / temperature + g, where g is Gumbel noise made
from a hash of (request seed, position, token id): the Gumbel-max trick, which picks each token with
its softmax probability. Randomness comes from the hash, not from a generator's state, so a seeded
request samples the same tokens whatever else is in its batch, on any device, and every
tensor-parallel rank (holding the same logits) samples the same token without a broadcast. Top-k and
top-p mask the tokens they drop (to -inf) before the draw; a row that filters nothing keeps its
logits as they are, so it draws the same token in a batch where other rows filter. A greedy row
(temperature 0) is exactly the argmax.

This module is the reference: plain torch, any device. `worker.triton_ops.sample_rows` computes the
same draw in two kernels over many blocks (the engine's path on CUDA, inside the decode graph)."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1: the Gumbel uniform's bound (see gumbel_noise)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # an integer finalizer with multipliers below 2**31, so int64 products never overflow
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x6C8E9CF5) & _MASK32
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row (int64 holding 0..2**32-1), a pure function of (seed, position)."""
    seeds, positions = seeds.long(), positions.long()
    h = _mix32(seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32 ^ 0x5BD1E995)
    return _mix32(h ^ _mix32(positions & _MASK32))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab]: Gumbel noise of token t in row b, from the hash of (keys[b], t). The uniform
    is (k + 0.5) / 2**24 for the hash's top 24 bits k, kept strictly inside (0, 1): in float32 the top
    value 2**24 - 0.5 rounds to 2**24, a uniform of exactly 1 and noise of +inf, which made a token
    masked to -inf (a grammar's, top-k's, min_tokens' ban) NaN and argmax's pick, and any other token
    the draw whatever its probability. It is held at the largest float32 below 1 (noise 16.6)."""
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64).unsqueeze(0)
    k = keys.unsqueeze(1)
    e = _mix32(_mix32(k ^ tokens) ^ k)
    u = (((e >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)).clamp(max=U_MAX)
    return -torch.log(-torch.log(u))


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    return 1.0 / temperature.float().clamp(min=1e-5)


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """int64 [B]: the argmax of logits where temperature <= 0, else the Gumbel-max draw."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    noisy = x * inverse_temperature(temperature).unsqueeze(1) + gumbel_noise(row_keys(seeds, positions), x.shape[1])
    return torch.where(temperature <= 0, greedy, noisy.argmax(dim=-1))


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 logits with the tokens top-k, top-p and min-p drop set to -inf (computed on
    softmax(logits / T); min-p drops tokens less likely than min_p times the most likely one); a row
    with top_k <= 0, top_p >= 1 and min_p 0 comes back unchanged. The most likely token is always kept."""
    x = logits.float()
    probs = torch.softmax(x * inverse_temperature(temperature).unsqueeze(1), dim=-1)
    probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    keep_sorted = (rank < k) & ((before < top_p.unsqueeze(1)) | (top_p >= 1).unsqueeze(1) | (rank == 0))
    if min_p is not None:
        keep_sorted &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x.masked_fill(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """float32 logits with the tokens less likely than min_p times the most likely one (on
    softmax(logits / T)) set to -inf: no sort needed. A row with min_p 0 comes back unchanged."""
    x = logits.float()
    probs = torch.softmax(x * inverse_temperature(temperature).unsqueeze(1), dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(~keep, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    any_filter: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> int64 [B]. `any_filter` (known on the host: some row has
    top_k > 0, top_p < 1 or min_p > 0) adds the filter's mask; without it the mask is skipped."""
    if any_filter:
        logits = filter_logits(logits, temperature, top_p, top_k, min_p)
    return sample_unfiltered(logits, temperature, seeds, positions)
