"""Matrix-vector products of batch-1 decode in Triton, where cuBLAS reads a layer's weights well below
the memory's bandwidth: the GEMV (`small_linear`), and the same with the residual norm before it
(`norm_linear`) or SiLU-and-multiply before it (`silu_linear`) in one launch
(worker/layers/row_fusion.py decides where those apply). On the CPU they run only under Triton's
interpreter, for an engine whose Kernels ask for it (the tests)."""

from __future__ import annotations

import functools

import torch

from worker import triton_ops
from worker.kernels import Kernels


@functools.cache
def _kernels():
    try:
        from worker import gemv_kernels
    except ImportError:  # no Triton here
        return None
    return gemv_kernels


def small_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` can compute x @ weight.T (the caller's Kernels.small_linear asks for it)."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and _kernels() is not None
    )


def small_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
    gated: bool = False,
    prefetch_programs: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T for small M (a GEMV-like kernel that reads each weight once). `pdl`:
    launched with programmatic dependent launch, the first `prefetch_programs` programs' weight rows
    prefetched before the wait (by default triton_ops.prefetch_programs's rule). `gated`:
    weight is [gate; up] and the result silu(x gate.T) * (x up.T) [M, N / 2], SiLU-and-multiply in the
    GEMV's epilogue."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    # the fastest at M=1 over Qwen3-0.6B's layers in bench/small_gemm.py: one output column a program up
    # to N = 2048, two beyond, 1024 of K a step, four warps (gated: the weight rows of the ungated GEMV's
    # program, half of them gate rows and half up rows)
    block_n = block_n or ((1 if gated or n <= 2048 else 2) if x.is_cuda else triton_ops.INTERPRETED_BLOCK_N)
    block_k, num_warps = block_k or 1024, num_warps or 4
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _kernels().small_linear_kernel[(triton_ops.triton.cdiv(n, block_n),)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        triton_ops.prefetch_programs(weight, pdl, prefetch_programs),
        M_BLOCK=triton_ops.triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GATED=gated,
        PDL=pdl,
        num_warps=num_warps,
        **triton_ops.pdl_options(pdl),
    )
    return out


def row_fusion_applies(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row's residual norm (or SiLU-and-multiply) and the GEMV after it can run as one launch
    (`norm_linear`, `silu_linear`): batch-1 decode, with both the fused norms and the small-M GEMV asked
    for, in half precision on CUDA (and in any float dtype under the interpreter), the weight in the row's
    dtype or e4m3 (a caller passing e4m3 checks that the GPU converts it: quant.gemm.triton_runs)."""
    if not (kernels.fused and kernels.small_linear and x.dim() == 2 and x.shape[0] == 1):
        return False
    if x.is_cuda:
        dtype_ok = x.dtype in (torch.bfloat16, torch.float16)
    else:
        dtype_ok = triton_ops.interpreted(kernels) and x.dtype.is_floating_point
    return (
        dtype_ok
        and weight.dtype in (x.dtype, torch.float8_e4m3fn)
        and weight.device == x.device
        and x.is_contiguous()
        and weight.is_contiguous()
        and _kernels() is not None
    )


# The largest weight tile (output columns a program x the row padded to a power of two) norm_linear loads in
# one block by default: the largest measured. bench/row_fusion.py on an H100 (2026-12-05), us a layer
# against the two passes: Qwen3-0.6B's qkv 5.35 against 5.84 and gate-up 6.63 against 7.72 (K = 1,024, 2
# and 4 columns), Qwen3-30B-A3B's qkv 9.38 against 11.32 (K = 2,048, 4 columns) and its router 2.14
# against 3.41 (2 columns); at Qwen3-8B's 4,096-wide rows with 2 columns (the fastest of 1-8 there) qkv
# 19.31 and gate-up 66.17 against the separate norm and GEMV's 22.06 and 68.46. So the default narrows a
# program's columns to fit (from _norm_block_n's); an explicit wider tile keeps the two passes (8 columns of
# a 2,048-wide row would take 128 registers a thread for sm_90 against the two passes' 56)
ONE_BLOCK_MAX_ELEMENTS = 8192


def _norm_block_n(n: int) -> int:
    """Output columns a program of norm_linear: the fastest of 1-16 on an H200 (bench/row_fusion.py) at
    N = 128 and 4,096 (2) and 5,120 and 6,144 (4); 8 was at 24,576."""
    return 2 if n <= 4096 else 4 if n <= 16384 else 8


def _silu_block_n(n: int) -> int:
    """Output columns a program of silu_linear: the fastest at N = 1,024 (1) and 4,096 (2)."""
    return 1 if n <= 1024 else 2


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    write_normed: bool = False,
    block_n: int | None = None,
    block_k: int = 1024,
    num_warps: int = 4,
    one_block: bool | None = None,
    pdl: bool = False,
    prefetch_programs: int | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For one row x [1, K]: (rmsnorm(x + residual) @ weight.T, the new residual x + residual (x itself
    without one), the normed row with write_normed) in one launch. x and residual are left as they are.
    `one_block`: the whole row in one block, every load issued before the norm's sum, or two passes over
    blocks of `block_k` (the sum, then the GEMV); by default one block where a program's weight tile holds
    at most ONE_BLOCK_MAX_ELEMENTS (the default columns a program narrowed to fit it). `pdl`,
    `prefetch_programs`: as small_linear's. `scale`: weight is e4m3 (FP8), its scale a row [rows], or with
    `block` (rows, columns) a row and block of columns [rows, K / columns], as quant.gemm.fp8_gemv takes them
    (bench/row_fusion.py times it; the engine does not run FP8 norms here: row_fusion.norm_fuses says why,
    and row_fusion.rms_fuses where they go instead).
    `gated`: weight is [gate; up] and the product silu(gate) * up [1, N / 2], as small_linear's (a program's
    tile then holds both halves' rows)."""
    k = x.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    k_pow2 = triton_ops.triton.next_power_of_2(k)
    tile_k = k_pow2 * (2 if gated else 1)  # the weight elements a program's column loads in one block
    if block_n is None:
        block_n = _norm_block_n(n)
        if one_block is not False and ONE_BLOCK_MAX_ELEMENTS // tile_k >= 1:
            block_n = min(block_n, ONE_BLOCK_MAX_ELEMENTS // tile_k)
    if one_block is None:
        one_block = block_n * tile_k <= ONE_BLOCK_MAX_ELEMENTS
    if one_block:
        block_k = k_pow2
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if write_normed else None
    _kernels().norm_linear_kernel[(triton_ops.triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight,
        weight,
        out,
        res_out,
        normed if normed is not None else x,
        n,
        k,
        weight.stride(0),
        eps,
        scale if scale is not None else weight,
        scale.stride(0) if scale is not None else 0,
        block[1] if block is not None else k,
        triton_ops.prefetch_programs(weight, pdl, prefetch_programs),
        HAS_RES=residual is not None,
        WRITE_NORMED=write_normed,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, k_pow2),
        ONE_BLOCK=one_block,
        SCALED=scale is not None,
        BLOCKED=scale is not None and block is not None,
        GATED=gated,
        PDL=pdl,
        num_warps=num_warps,
        **triton_ops.pdl_options(pdl),
    )
    return out, res_out, normed


def silu_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int = 1024,
    num_warps: int = 4,
    pdl: bool = False,
    prefetch_programs: int | None = None,
) -> torch.Tensor:
    """For one row gate_up [1, 2K] = [gate | up]: (silu(gate) * up) @ weight.T in one launch (`pdl`,
    `prefetch_programs`: as small_linear's)."""
    k = gate_up.shape[1] // 2
    n = weight.shape[0]
    block_n = block_n or _silu_block_n(n)
    out = torch.empty(1, n, dtype=gate_up.dtype, device=gate_up.device)
    _kernels().silu_linear_kernel[(triton_ops.triton.cdiv(n, block_n),)](
        gate_up,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        triton_ops.prefetch_programs(weight, pdl, prefetch_programs),
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton_ops.triton.next_power_of_2(k)),
        PDL=pdl,
        num_warps=num_warps,
        **triton_ops.pdl_options(pdl),
    )
    return out
