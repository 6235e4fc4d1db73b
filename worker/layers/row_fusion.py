"""What precedes a linear, run inside the kernel around it. Batch-1 decode runs each residual norm inside
the GEMV that reads its output, and SiLU-and-multiply inside the down projection's GEMV
(worker/gemv_kernels.py: norm_linear_kernel, silu_linear_kernel): at one row a layer's small kernels cost
more in launches and ramp than in bytes (a residual norm took 2.6 us of GPU time for 2 KiB to 8 KiB), three
launches fewer a dense layer, two a mixture of experts' (Qwen3-0.6B's batch-1 decode: 0.954 ms a token
against 1.026). Wider rows (NORM_MAX_K, SILU_MAX_K), quantized layers and the CPU (outside the
interpreter) run the norm and the GEMV apart; where the SiLU cannot go into down's GEMV it goes into the
epilogue of gate-up's instead (`gate_up_silu`, bf16 or FP8, with the norm in the same launch where it
fits: `norm_gate_up_silu`), each program computing a gate row and its up row. An FP8 model's norms go
inside its GEMVs another way where Kernels.fp8_norms asks (`rms_fuses`, `linear_add`): the residual add in
the epilogue of the GEMV before, the norm of the one row it writes in the pass of the GEMV after. At more
rows, an FP8 linear's per-token activation quantization runs inside the norm or SiLU before it instead
(worker/quant/fused_quant.py)."""

from __future__ import annotations

import torch
from torch import nn

from worker import gemv, triton_ops
from worker.kernels import Kernels
from worker.layers.linear import RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.quant import fused_quant, gemm
from worker.quant.fp8 import Fp8Weights

# The widest row each fusion pays at. Every program of the fused GEMV reads the whole row itself (x and the
# residual twice and the norm's weight for a norm; gate and up for SiLU), which beside a few weight rows
# a program doubles what it reads from L2 on wide rows. On an H200 (bench/row_fusion.py, 2026-12-04) the
# fused norm in two passes saved 0.1-0.7 us a layer at 1,024 and 2,048 and lost 0.8-2.2 at 4,096; the
# fused SiLU saved 0.3 at 3,072 and lost 7 at 12,288. In one block (gemv.ONE_BLOCK_MAX_ELEMENTS) the norm
# saves at 4,096 too: 2.8 and 2.3 us a layer on Qwen3-8B on an H100 (2026-12-05).
NORM_MAX_K = 4096
SILU_MAX_K = 3072


def _plain(linear: nn.Module) -> bool:
    """A layer whose forward is the small-M GEMV over its weight (no quantization), bias or not."""
    return getattr(linear, "quant", None) is None and getattr(linear, "small", False)


def norm_linear(
    norm: RMSNorm,
    linear: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    kernels: Kernels,
    want_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(linear(norm(x + residual)), the new residual, the normed rows when want_normed) as a decoder layer
    takes them: without a residual (the first layer's input norm) x is the residual. One launch at one
    row; the norm then the linear otherwise."""
    y = None
    if not want_normed and rms_fuses(linear, x, residual, kernels):
        y, normed = _fp8_gemv(linear, x, kernels, norm=row_norm(norm)), None
        residual = x
    elif not want_normed and (residual is None or residual.is_contiguous()) and fused_quant.applies(linear, x, kernels):
        xq, xs, residual = fused_quant.norm_quant(x, residual, norm.weight, norm.eps)
        y, normed = fused_quant.matmul(linear, xq, xs, x.dtype), None
    elif norm_fuses(linear, x, kernels):
        pdl = triton_ops.pdl_applies(kernels, x.device)
        y, residual, normed = gemv.norm_linear(x, residual, norm.weight, norm.eps, linear.weight, want_normed, pdl=pdl)
    if y is not None:
        bias = getattr(linear, "bias", None)
        return (y if bias is None else y + bias), residual, normed
    normed, residual = norm.of_stream(x, residual)
    return linear(normed), residual, normed if want_normed else None


def norm_fuses(linear: nn.Module, x: torch.Tensor, kernels: Kernels) -> bool:
    """Whether `norm_linear` runs the residual norm inside linear's GEMV (one row, K up to NORM_MAX_K, an
    unquantized linear). Not an FP8 linear's: every program of the fused GEMV reads the whole row for the
    norm, against half the weight bytes of bf16 beside it. On an H100 (bench/row_fusion.py, 2026-12-05, us
    a layer, Qwen3-8B) the norm inside FP8 gate-up's GEMV with the SiLU took 49.30 (44.69 in two passes)
    against the separate norm and GEMV's 38.94, 152.09 against 118.68 with 128 x 128 block scales, and
    inside qkv's 14.07 against 14.30."""
    return x.shape[-1] <= NORM_MAX_K and _plain(linear) and gemv.row_fusion_applies(kernels, x, linear.weight)


def rms_fuses(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels) -> bool:
    """Whether `norm_linear` runs linear's FP8 GEMV over the RMS norm of x itself (gemm.fp8_gemv's `norm`),
    in its one pass over the row: Kernels.fp8_norms inside or folded, one row x that is the whole residual
    stream (no residual left to add: the GEMV before added it in its epilogue, `linear_add`), an FP8
    linear on the Triton GEMV. The norm's own launch goes, and nothing is read twice."""
    return kernels.fp8_norms_inside and residual is None and _fp8_gemv_runs(linear, x, kernels)


def _fp8_gemv_runs(linear: nn.Module, x: torch.Tensor, kernels: Kernels) -> bool:
    """Whether linear's forward over x is the FP8 GEMV: an FP8 linear at one contiguous row on the Triton
    kernels, with the fused kernels asked for."""
    return (
        kernels.fused
        and isinstance(getattr(linear, "quant", None), Fp8Weights)
        and linear.small
        and x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and gemm.triton_runs(x, kernels)
    )


def row_norm(norm: RMSNorm) -> gemm.RowNorm:
    """The norm as the FP8 GEMV computes it: without its weight where the weight is folded into the linear's."""
    return gemm.RowNorm(None if norm.folded else norm.weight, norm.eps)


def _fp8_gemv(linear: nn.Module, x: torch.Tensor, kernels: Kernels, **kw) -> torch.Tensor:
    """An FP8 linear's GEMV over one row x (gemm.fp8_gemv with the layer's weight, scales and PDL; `kw`: its
    norm, residual or gating), without the layer's bias."""
    quant = linear.quant
    pdl = triton_ops.pdl_applies(kernels, x.device)
    return gemm.fp8_gemv(x, linear.weight, quant.scale_of(linear), quant.block, pdl=pdl, **kw)


def linear_add(
    linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(x), residual) as a decoder layer takes them after its attention or feed-forward block, or
    (linear(x) + residual, None) with the add inside the FP8 GEMV's epilogue: where Kernels.fp8_norms is
    inside or folded and linear is a row-parallel FP8 linear on one GPU without a bias (its output is the
    whole sum, nothing is added after it). The next norm then reads one row (`rms_fuses`)."""
    if residual is not None and adds_residual(linear, x, residual, kernels):
        return _fp8_gemv(linear, x, kernels, residual=residual), None
    return linear(x), residual


def adds_residual(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels) -> bool:
    """Whether `linear_add` adds the residual inside linear's FP8 GEMV (see there)."""
    return (
        kernels.fp8_norms_inside
        and isinstance(linear, RowParallelLinear)
        and linear.reduce
        and linear.tp.size == 1
        and linear.bias is None
        and residual.shape == (1, linear.weight.shape[0])
        and residual.dtype == x.dtype
        and residual.is_contiguous()
        and _fp8_gemv_runs(linear, x, kernels)
    )


def gate_up_silu_applies(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, kernels: Kernels) -> bool:
    """Whether `gate_up_silu` computes silu(gate) * up of one row x in one launch: gate-up's GEMV (bf16, or
    FP8 with either scale layout) with SiLU-and-multiply in its epilogue, where down's GEMV cannot take the
    SiLU itself (`silu_linear`: rows wider than SILU_MAX_K, or a quantized down). One launch fewer a layer,
    and the [1, 2 x inter] row is never written."""
    if x.dim() != 2 or x.shape[0] != 1 or not kernels.fused or getattr(gate_up, "bias", None) is not None:
        return False
    if gate_up.weight.shape[0] // 2 <= SILU_MAX_K and _plain(down):
        return False  # silu_linear runs it inside down's GEMV
    quant = getattr(gate_up, "quant", None)
    if quant is None:
        return _plain(gate_up) and gemv.row_fusion_applies(kernels, x, gate_up.weight)
    return isinstance(quant, Fp8Weights) and gate_up.small and x.is_contiguous() and gemm.triton_runs(x, kernels)


def gate_up_silu(gate_up: nn.Module, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """silu(gate) * up [1, inter] of one row x from gate-up's GEMV (where gate_up_silu_applies)."""
    if gate_up.quant is None:
        return gemv.small_linear(x, gate_up.weight, pdl=triton_ops.pdl_applies(kernels, x.device), gated=True)
    return _fp8_gemv(gate_up, x, kernels, gated=True)


def norm_gate_up_silu(
    norm: RMSNorm, gate_up: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up of norm(x + residual) [1, inter], the new residual) where gate_up_silu_applies: the
    norm inside the same launch where it fits (norm_fuses, or an FP8 GEMV's where rms_fuses), on its own
    before it otherwise. Without a residual x is the residual stream."""
    if rms_fuses(gate_up, x, residual, kernels):
        return _fp8_gemv(gate_up, x, kernels, gated=True, norm=row_norm(norm)), x
    if norm_fuses(gate_up, x, kernels):
        pdl = triton_ops.pdl_applies(kernels, x.device)
        act, residual, _ = gemv.norm_linear(x, residual, norm.weight, norm.eps, gate_up.weight, pdl=pdl, gated=True)
        return act, residual
    normed, residual = norm.of_stream(x, residual)
    return gate_up_silu(gate_up, normed, kernels), residual


def silu_linear(linear: nn.Module, gate_up: torch.Tensor, kernels: Kernels) -> torch.Tensor | None:
    """linear's GEMV over silu(gate) * up of one row in one launch, or an FP8 linear's GEMM over more rows
    with SiLU and the activations' quantization in one launch before it (before its all-reduce and bias,
    which the caller adds); None where neither applies."""
    if fused_quant.applies(linear, gate_up, kernels):
        xq, xs = fused_quant.silu_quant(gate_up)
        return fused_quant.matmul(linear, xq, xs, gate_up.dtype)
    if (
        gate_up.shape[-1] <= 2 * SILU_MAX_K
        and _plain(linear)
        and gemv.row_fusion_applies(kernels, gate_up, linear.weight)
    ):
        return gemv.silu_linear(gate_up, linear.weight, pdl=triton_ops.pdl_applies(kernels, gate_up.device))
    return None
