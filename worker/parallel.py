"""Who this rank is within its tensor-parallel group, and the collectives the layers need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Collectives(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def min_over_ranks(self, value: int) -> int: ...

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor: ...


class SingleRank:
    """The collectives of a group of one: every operation is the identity."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def min_over_ranks(self, value: int) -> int:
        return value

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    comm: Collectives = field(default_factory=SingleRank, compare=False)

    def shard(self, n: int, what: str) -> int:
        """The per-rank share of n items (heads, columns); they must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size
