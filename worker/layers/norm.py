"""RMSNorm, computed in float32 as Hugging Face does (one fused kernel on CUDA in half precision)."""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import Kernels
from worker.layers.fused import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels = Kernels()) -> None:
        super().__init__()
        self.eps = eps
        self.fused = kernels.fused
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # the weight was folded into the linear that reads this norm's output, and is ones here now
        # (worker/quant/fold.py): a GEMV computing the norm itself need not read it
        self.folded = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual), saving one pass.
        x: [..., dim]; on the fused path x and residual are updated in place."""
        ops = fused_ops(x) if self.fused else None
        if ops is not None:
            if residual is None:
                return ops.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def of_stream(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of the residual stream x + residual, that stream): without a residual x is the stream
        (the first layer's input, or after a GEMV that added it, worker/layers/row_fusion.py's linear_add)."""
        if residual is None:
            return self(x), x
        return self(x, residual)
