"""The sparse MoE block: router, top-k experts, optional shared expert (Qwen2-MoE) behind a sigmoid gate,
one all-reduce at the end."""

from __future__ import annotations

import torch
from torch import nn

from worker import triton_ops
from worker.kernels import Kernels
from worker.layers.linear import linear
from worker.layers.mlp import SwiGLU
from worker.layers.moe.fused import fused_applies, fused_moe, warm_token_counts
from worker.layers.moe.routing import select_experts
from worker.layers.moe.torch_experts import torch_experts
from worker.layers.moe.weights import Experts
from worker.layers.norm import RMSNorm
from worker.layers.row_fusion import norm_linear
from worker.parallel import TPGroup


class Router(nn.Module):
    """The gate: a replicated linear from the hidden state to one logit per expert."""

    def __init__(self, hidden: int, num_experts: int, kernels: Kernels = Kernels()) -> None:
        super().__init__()
        self.kernels = kernels
        self.small = kernels.small_linear  # a Triton GEMV at batch 1 (cuBLAS took 5 us for 0.5 MB)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, kernels=self.kernels)


class SparseMoeBlock(nn.Module):
    """`shared_intermediate` > 0 adds Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x)).
    Every part returns this rank's partial sums (the gate is replicated, so scaling a partial sum by it
    commutes with the sum), and the block all-reduces once."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPGroup,
        kernels: Kernels = Kernels(),
        shared_intermediate: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok = {top_k} must be between 1 and the {num_experts} experts")
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.kernels = kernels
        self.gate = Router(hidden, num_experts, kernels)
        self.experts = Experts(num_experts, hidden, intermediate, tp)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate, tp, kernels, reduce=False)
            self.shared_expert_gate = Router(hidden, 1, kernels)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, self.gate(x))

    def forward_after_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over norm(x + residual), and the new residual (x itself the residual stream without
        one): at one row the norm runs inside the router's GEMV, which also writes the normed row for the
        experts."""
        logits, residual, normed = norm_linear(norm, self.gate, x, residual, self.kernels, want_normed=True)
        return self._experts(normed, logits), residual

    def _experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        if fused_applies(self.kernels, x):
            pdl = triton_ops.pdl_applies(self.kernels, x.device)
            out = fused_moe(x, logits, w13, w2, self.top_k, self.renormalize, pdl, self.experts.scales())
        else:  # FP8 experts are kept only where the fused path runs (worker/quant/experts.py)
            out = torch_experts(x, w13, w2, *select_experts(logits, self.top_k, self.renormalize))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp.size > 1:
            out = self.tp.comm.all_reduce(out)
        return out

    def warm_kernels(self) -> None:
        """Runs the fused path once at each of warm_token_counts (zeros in, nothing kept, no collective):
        Triton compiles every variant a step can take here, not in a live step."""
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        hidden, num_experts = w13.shape[2], w13.shape[0]
        if not fused_applies(self.kernels, w13[:1, :1]):
            return
        dtype = self.gate.weight.dtype  # the model's (FP8 experts' weights are e4m3)
        pdl = triton_ops.pdl_applies(self.kernels, w13.device)
        for tokens in warm_token_counts(num_experts, self.top_k):
            x = torch.zeros(tokens, hidden, dtype=dtype, device=w13.device)
            logits = torch.zeros(tokens, num_experts, dtype=dtype, device=w13.device)
            fused_moe(x, logits, w13, w2, self.top_k, self.renormalize, pdl, self.experts.scales())
