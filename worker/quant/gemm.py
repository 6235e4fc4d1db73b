"""The GEMMs of FP8 linears. On CUDA (compute capability 8.9+): at one row (batch-1 decode) a Triton GEMV
that reads the e4m3 weight once and scales in its loop (the activations stay in bf16); per-channel weights
otherwise, after a per-token activation quantization, through the Triton GEMM of worker/skinny_gemm.py where
Kernels.decode_gemm chooses it (decode batches) or cuBLASLt cannot (fp16 out, widths not multiples of 16),
and cuBLASLt (`torch._scaled_mm`, rowwise scales, bf16 out) elsewhere;
block-scaled weights through the Triton GEMM after a per-token, per-128-column-group quantization. Elsewhere
(the CPU) the weight is dequantized to the activations' dtype for F.linear. Nothing here synchronizes the
host, so all of it runs inside CUDA graphs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker import skinny_gemm, triton_ops
from worker.kernels import Kernels

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class RowNorm:
    """The RMS norm a GEMV computes over its input row itself (`fp8_gemv`'s `norm`): its weight [K], or None
    where the weight is folded into the GEMV's (worker/quant/fold.py), and its epsilon."""

    weight: torch.Tensor | None
    eps: float


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    small: bool = True,
    kernels: Kernels = Kernels(),
) -> torch.Tensor:
    """x [M, K] @ dequantized(weight [N, K], scale).T (+ bias). `small`: the GEMV at M = 1."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = _matmul(x2, weight, scale, block, small, kernels)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def _matmul(x, weight, scale, block, small, kernels) -> torch.Tensor:
    if not triton_runs(x, kernels):
        if x.is_cuda and block is None and scaled_mm_applies(x, weight):
            return scaled_mm(x, weight, scale, kernels)
        return dequantized_linear(x, weight, scale, block)
    if small and x.shape[0] == 1:
        return fp8_gemv(x, weight, scale, block, pdl=triton_ops.pdl_applies(kernels, x.device))
    if block is None:
        if scaled_mm_applies(x, weight):
            return scaled_mm(x, weight, scale, kernels)
        if x.dtype == torch.float16 or (x.is_cuda and x.dtype == torch.bfloat16):
            # what cuBLASLt's rowwise-scaled GEMM does not take: fp16 out (rounding the product to bf16 would
            # lose fp16's three extra bits) and widths not multiples of 16 (an LM head's vocabulary shard). The
            # Triton GEMM takes both and never widens the weight, where dequantized_linear makes a float32 copy
            # of it per call
            xq, xs = quantize_activations(x.contiguous(), x.shape[1])
            return skinny_gemm.matmul(xq, weight, x.dtype, xs, scale)
        return dequantized_linear(x, weight, scale, block)
    return block_scaled_mm(x, weight, scale, block[1])


# the columns of a scale block the Triton kernels step through K by (tl.arange and tl.dot's bounds; the GEMV's
# 2,048 columns a step hold whole blocks)
MIN_BLOCK_WIDTH, MAX_BLOCK_WIDTH = 16, 2048


def block_width_runs(width: int) -> bool:
    """Whether the Triton FP8 kernels take scale blocks `width` columns wide."""
    return MIN_BLOCK_WIDTH <= width <= MAX_BLOCK_WIDTH and width & (width - 1) == 0


def dequantized_linear(x, weight, scale, block) -> torch.Tensor:
    from worker.quant.fp8 import dequantize

    return F.linear(x, dequantize(weight, scale, block).to(x.dtype))


def triton_runs(x: torch.Tensor, kernels: Kernels) -> bool:
    """The Triton FP8 kernels for x: on a GPU that converts e4m3 (8.9+), or under the interpreter (tests)."""
    if _fp8_kernels() is None:
        return False
    if x.is_cuda:
        return fp8_supported(x.device)
    return kernels.interpret_on_cpu and kernels.triton and triton_ops._interpreter()


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLASLt's rowwise-scaled FP8 GEMM: bf16 out, both widths multiples of 16."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kernels: Kernels = Kernels()) -> torch.Tensor:
    xq, xs = quantize_activations(x, x.shape[1])
    return scaled_mm_quantized(xq, xs, weight, scale, x.dtype, kernels)


def scaled_mm_quantized(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    kernels: Kernels = Kernels(),
) -> torch.Tensor:
    """e4m3 activations [M, K] with per-token scales [M, 1] @ an e4m3 weight [N, K] with per-channel scales [N]:
    the Triton GEMM (worker/skinny_gemm.py) or cuBLASLt's by Kernels.decode_gemm."""
    if skinny_gemm.chosen(kernels, xq.shape[0], weight):
        return skinny_gemm.matmul(xq, weight, out_dtype, xs, scale)
    # weight [N, K] row-major is the column-major [K, N] that cuBLASLt wants as its second operand
    # fast accumulation: up to 14% faster on Qwen3-8B's layers at 64 and 256 rows, about the same error against
    # float32 (bench/fp8_gemm.py, docs/BENCHMARKS.md)
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=out_dtype, use_fast_accum=True
    )


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): one scale per row and group of
    `group` columns (group = K: per token), each group's largest magnitude at 448."""
    m, k = x.shape
    groups = -(-k // group)
    # not under the interpreter, which rounds to e4m3 wrongly (worker/triton_ops.py cache_dtype_supported)
    if _fp8_kernels() is not None and x.is_cuda and x.is_contiguous():
        xq = torch.empty(m, k, dtype=FP8, device=x.device)
        xs = torch.empty(m, groups, dtype=torch.float32, device=x.device)
        if m:
            block = min(1024, triton_ops.triton.next_power_of_2(group))
            _fp8_kernels().quantize_groups_kernel[(m, groups)](
                x, xq, xs, k, x.stride(0), group, BLOCK=block, num_warps=4
            )
        return xq, xs
    return quantize_activations_torch(x, group)


def quantize_activations_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    xs = (padded.abs().amax(dim=2) / 448.0).clamp(min=1e-12)
    xq = (padded / xs[:, :, None]).clamp(-448.0, 448.0).to(FP8).view(m, groups * group)[:, :k]
    return xq.contiguous(), xs


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ weight [N, K] e4m3 with scales [N, ceil(K / group_k)]: the activations
    quantized per token per group_k columns, the products summed in float32 block by block."""
    xq, xs = quantize_activations(x.contiguous(), group_k)
    return skinny_gemm.matmul(xq, weight, x.dtype, xs, scale, group_k)


# Whether the GEMV over block-scaled weights loads their scales a block at a time (`fp8_gemv`'s `grouped`)
# by default. Qwen3-8B's layers at one row over 128 x 128 blocks on an H100 (bench/fp8_gemv.py --blocks,
# 2026-12-06, us, a scale for every weight / a block at a time): qkv 36.3 / 11.6, o 25.6 / 8.2, gate-up
# 115.9 / 36.4, down 71.1 / 20.3. Compiled for sm_90 it holds 54 registers a thread against 160.
GROUPED_BLOCK_SCALES = True


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
    gated: bool = False,
    prefetch_programs: int | None = None,
    grouped: bool | None = None,
    norm: RowNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (a few rows) @ dequantized(weight).T, reading each e4m3 weight once; the scales applied in
    float32 (per channel at the end, per block in the loop). `pdl`, `prefetch_programs`: as
    gemv.small_linear's. `gated`: as gemv.small_linear's (weight [gate; up],
    the result silu(gate) * up). `grouped`: block scales loaded a block at a time and applied to the
    blocks' sums, not loaded for every weight (block_k a multiple of the block's columns); by default
    GROUPED_BLOCK_SCALES. `norm` (one row): x is the residual stream and the GEMV reads its RMS norm, in
    the same pass. `residual` [1, N] (one row, not gated): added to the product, rounded first as a
    separate add reads it."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if (norm is not None or residual is not None) and m != 1:
        raise ValueError(f"the norm and the residual add inside the FP8 GEMV take one row, not {m}")
    if norm is not None and norm.weight is not None and norm.weight.shape != (k,):
        raise ValueError(f"the norm's weight inside the FP8 GEMV must be [{k}], not {list(norm.weight.shape)}")
    if residual is not None and (gated or residual.shape != (1, n) or not residual.is_contiguous()):
        raise ValueError(f"the residual added in the FP8 GEMV's epilogue must be one contiguous [1, {n}] row")
    # the fastest at M=1 over Qwen3-8B's layers in bench/fp8_gemv.py: four output rows a program, 2048
    # of K a step (1024 read 7-15% slower), four warps (gated: as many weight rows as the ungated GEMV of
    # 2N rows reads, half of them gate rows and half up rows)
    block_n = block_n or ((2 if n <= 2048 or gated else 4) if x.is_cuda else triton_ops.INTERPRETED_BLOCK_N)
    block_k, num_warps = block_k or 2048, num_warps or 4
    group_k = block[1] if block is not None else k
    grouped = GROUPED_BLOCK_SCALES if grouped is None else grouped
    if grouped and block is not None and block_k % group_k:
        raise ValueError(f"grouped block scales need block_k ({block_k}) a multiple of the block's columns ({group_k})")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fp8_kernels().fp8_gemv_kernel[(triton_ops.triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        group_k,
        triton_ops.prefetch_programs(weight, pdl, prefetch_programs),
        M_BLOCK=triton_ops.triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCKED=block is not None,
        GATED=gated,
        PDL=pdl,
        GROUPS=block_k // group_k if grouped and block is not None else 0,
        res_ptr=residual,
        norm_w_ptr=None if norm is None else norm.weight,
        eps=0.0 if norm is None else norm.eps,
        RMS=norm is not None,
        NORM_WEIGHT=norm is not None and norm.weight is not None,
        ADD_RESIDUAL=residual is not None,
        num_warps=num_warps,
        **triton_ops.pdl_options(pdl),
    )
    return out


@functools.cache
def _fp8_kernels():
    try:
        from worker.quant import fp8_kernels
    except ImportError:  # no Triton here
        return None
    return fp8_kernels
