"""The attention-backend interface: plan once per step, then attend once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from worker.batch import BatchDesc, ForwardBatch
from worker.kv_cache import KVCachePool


class AttentionBackend(ABC):
    kv: KVCachePool
    out_loc: torch.Tensor  # this step's KV-cache locations, one per token (set by prepare)

    def stage(self, desc: BatchDesc, rows: int) -> object | None:
        """The first part of a step's planning, which rewrites nothing the step before may still read
        (host arrays, and their copy to the device into a buffer of their own): the engine runs it
        before waiting for that step's forward, and passes what it returns to prepare. `rows`: the
        batch size the plan is for (a CUDA graph's bucket)."""
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch, staged: object | None = None) -> None:
        """Derive this step's metadata (shared by every layer) from the batch (and `stage`'s result)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write k and v at the batch's out_loc (unless they are None: already written), then attend q
        ([T, heads, head_dim]) over each request's cached prefix and its new tokens, causally.
        Returns [T, heads, head_dim]: `out` when given."""
