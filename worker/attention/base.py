"""The attention-backend interface: plan once per step, then attend once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from worker.batch import BatchDesc, ForwardBatch
from worker.kv_cache import KVCachePool


@dataclass(frozen=True)
class DecodePrologue:
    """The attention prologue done inside the decode kernel (one token a request): qkv [B, (H + 2 KV) * D],
    the projection's output, contiguous; positions [B], the new tokens' (for the rotation); cos_sin
    [positions, D], cos over its first half and sin over its second; q_weight and k_weight [D], the q/k
    norms' weights (None: no norm), with eps. The new tokens' keys and values are written to the cache at
    each request's last position, through its pages."""

    qkv: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0


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

    def takes_prologue(self) -> bool:
        """Whether this step's attention computes the prologue itself (forward_prologue)."""
        return False

    def forward_prologue(self, prologue: DecodePrologue, layer_id: int, num_heads: int) -> torch.Tensor:
        """The attention of a decode step from the projection's output (DecodePrologue): the
        queries normed and rotated and the new keys and values written inside the attention's kernel.
        Returns [T, num_heads, head_dim]. Only where takes_prologue."""
        raise NotImplementedError(f"{type(self).__name__} does not take the prologue")
