"""An FP8 linear's activation quantization inside the kernel before it. At more than one row, a linear with
per-channel e4m3 weights multiplies its input quantized per token (gemm.scaled_mm: the Triton GEMM of
worker/skinny_gemm.py at decode batches where it pays, cuBLASLt elsewhere), and that quantization was a
launch that reads the row the kernel before just wrote. Where that kernel is the
residual RMSNorm (before QKV and gate-up) or SiLU-and-multiply (before down), one Triton kernel does both
and writes e4m3 and the row's scale; the normed (or SiLU) row in bfloat16 is never written. The numbers are
the unfused path's: the norm and SiLU computed in float32 and rounded to bfloat16 once, as FlashInfer's
kernels compute and round them, then the same per-token quantization. On Qwen3-8B's decode at 256 rows the
separate quantizations took 0.39 ms of each step (2026-12-03); 3 of a layer's 4 now ride along (o's input
comes from attention)."""

from __future__ import annotations

import torch
from torch import nn

from worker import triton_ops
from worker.kernels import Kernels
from worker.quant import gemm

FP8 = torch.float8_e4m3fn
# the most columns a program takes a step (each pass): a row of up to 4,096 (Qwen3-8B's hidden width) in one
# step, so each pass waits on memory once; eight warps at that, 16 columns a thread
MAX_BLOCK = 4096


def _tile(width: int) -> dict:
    block = min(MAX_BLOCK, triton_ops.triton.next_power_of_2(width))
    return {"BLOCK": block, "num_warps": max(4, block // 512)}


def applies(linear: nn.Module, x: torch.Tensor, kernels: Kernels) -> bool:
    """Whether x's quantization for `linear` can run inside the kernel before it: a per-channel FP8 linear
    multiplying its quantized input (CUDA, bfloat16, more than the GEMV's one row), with the fused kernels on."""
    quant = getattr(linear, "quant", None)
    return (
        kernels.fused
        and quant is not None
        and getattr(quant, "block", True) is None  # per-channel scales: block-scaled ones group their columns
        and x.is_cuda
        and x.dim() == 2
        and x.is_contiguous()
        and x.shape[0] > 0
        and not (linear.small and x.shape[0] == 1)  # one row: the FP8 GEMV reads bfloat16 itself
        and gemm.triton_runs(x, kernels)
        and gemm.scaled_mm_applies(x, linear.weight)
    )


def norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scales [M, 1], the new residual) of RMSNorm(x + residual) * weight, the residual
    updated in place as the fused norm updates it; without one, x is the residual."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=FP8, device=x.device)
    xs = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    has_residual = residual is not None
    res = residual if has_residual else x
    gemm._fp8_kernels().rmsnorm_quant_kernel[(m,)](
        x,
        res,
        weight,
        xq,
        xs,
        k,
        eps,
        x.stride(0),
        res.stride(0),
        HAS_RESIDUAL=has_residual,
        **_tile(k),
    )
    return xq, xs, res


def silu_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scales [M, 1]) of silu(gate) * up for gate_up = [gate | up]."""
    m, width = gate_up.shape
    inter = width // 2
    xq = torch.empty(m, inter, dtype=FP8, device=gate_up.device)
    xs = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    gemm._fp8_kernels().silu_quant_kernel[(m,)](gate_up, xq, xs, inter, gate_up.stride(0), **_tile(inter))
    return xq, xs


def matmul(layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 linear `layer`'s product (its bias, and a row-parallel one's all-reduce, are the caller's)
    over activations already quantized per token."""
    return gemm.scaled_mm_quantized(xq, xs, layer.weight, layer.quant.scale_of(layer), out_dtype, layer.quant.kernels)
