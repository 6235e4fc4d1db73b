"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import Kernels
from worker.layers.fused import fused_ops
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.parallel import TPGroup


class SwiGLU(nn.Module):
    """`reduce` off: each rank returns its partial sums, for a block that all-reduces them with others."""

    def __init__(
        self, hidden: int, intermediate: int, tp: TPGroup, kernels: Kernels = Kernels(), reduce: bool = True
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=False, tp=tp, kernels=kernels
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, tp=tp, kernels=kernels, reduce=reduce)
        self.fused = kernels.fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = fused_ops(gate_up) if self.fused else None
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
