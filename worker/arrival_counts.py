"""Arrival counts of kernels that split a sum over programs: each program writes its partial and counts
itself in its output tile's count, and the last to arrive adds the partials in a fixed order (so the sum
does not depend on which came last), writes the tile and resets the count (worker/skinny_gemm_kernels.py's
split products, the mixture-of-experts down kernel's split over choices).

One buffer per stream: each launch's last program for a tile resets its count, so a buffer is zeroed once
and every launch finds it so, as long as no two launches that share it run at once. An engine launches on
its compute stream and captures its CUDA graphs there (worker/engine.py), and a stream runs its kernels one
at a time (with programmatic dependent launch too: a kernel reads its counts after it waits for the one
before); engines beside each other on one GPU (a draft model's) have streams, and buffers, of their own."""

from __future__ import annotations

import functools

import torch

MAX_TILES = 1 << 14
_counts: dict[tuple[torch.device, int], torch.Tensor] = {}


def counts(device: torch.device) -> torch.Tensor | None:
    """The current stream's counts on `device` (MAX_TILES of them, zero between launches); None (the sum
    then not split) where it has none yet and a CUDA graph is being captured, which would record the
    buffer's zeroing instead of running it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _counts:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counts[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counts[key]


@functools.cache
def placeholder(device: torch.device) -> torch.Tensor:
    """One int32 zero on `device`: what a launch that does not split passes for the counts (and, viewed as
    float32, for the partials), so that both variants take arguments of one type."""
    return torch.zeros(1, dtype=torch.int32, device=device)
