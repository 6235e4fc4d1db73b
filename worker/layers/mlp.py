"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import Kernels
from worker.layers.fused import fused_ops
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.row_fusion import (
    gate_up_silu,
    gate_up_silu_applies,
    linear_add,
    norm_gate_up_silu,
    norm_linear,
    silu_linear,
)
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
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gate_up_silu_applies(self.gate_up_proj, self.down_proj, x, self.kernels):
            return self.down_proj(gate_up_silu(self.gate_up_proj, x, self.kernels))
        return self.down(self.gate_up_proj(x))

    def forward_after_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block over norm(x + residual), and the new residual (x itself the residual stream without
        one). At one row the norm runs inside gate-up's GEMV where it fits; where down's GEMV cannot take the
        SiLU, gate-up's applies it (with the norm inside too where that fits), and an FP8 down's GEMV may add
        the residual itself (row_fusion.linear_add: then the new residual is None)."""
        if gate_up_silu_applies(self.gate_up_proj, self.down_proj, x, self.kernels):
            act, residual = norm_gate_up_silu(norm, self.gate_up_proj, x, residual, self.kernels)
            return linear_add(self.down_proj, act, residual, self.kernels)
        gate_up, residual, _ = norm_linear(norm, self.gate_up_proj, x, residual, self.kernels)
        return self.down(gate_up), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up): at one row in one launch."""
        y = silu_linear(self.down_proj, gate_up, self.kernels)
        if y is not None:
            return self.down_proj.finish(y)
        ops = fused_ops(gate_up) if self.fused else None
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
