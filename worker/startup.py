"""Where an engine's start goes: the seconds each part took, so a slow start says what was slow."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch


@dataclass
class StartupTimes:
    weights_s: float = 0.0  # the model built and its weights loaded (or drawn, for dummy weights)
    kv_cache_s: float = 0.0  # the KV cache, token pool, page table and sampler state allocated
    graphs_s: float = 0.0  # CUDA graphs captured (their kernels compiled, the first time on a host)
    warm_up_s: float = 0.0  # one step run: the prefill kernels compiled on first use

    @property
    def total_s(self) -> float:
        return self.weights_s + self.kv_cache_s + self.graphs_s + self.warm_up_s

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}

    def __str__(self) -> str:
        return (
            f"{self.total_s:.1f} s (weights {self.weights_s:.1f} s, KV cache {self.kv_cache_s:.1f} s, "
            f"CUDA graphs {self.graphs_s:.1f} s, warm-up {self.warm_up_s:.1f} s)"
        )


@contextmanager
def timed(times: StartupTimes, field: str, device: torch.device) -> Iterator[None]:
    """Adds the block's seconds to `field`, counting the device work it queued (a start-up phase only:
    it synchronizes)."""
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setattr(times, field, getattr(times, field) + time.perf_counter() - start)
