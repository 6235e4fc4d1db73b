"""Triton kernels of worker/quant/gemm.py (a module of their own: importing it needs Triton)."""

import triton
import triton.language as tl

from worker.gemv_kernels import silu_and_mul
from worker.pdl_kernels import gemv_rows

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, GROUP, BLOCK: tl.constexpr):
    # one program per (row, group of GROUP columns): the group's largest magnitude, then the group
    # divided by its scale (amax / 448), saturated, in e4m3
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        kk = k0 + offs
        x = tl.load(x_ptr + row * x_stride + kk, mask=kk < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row * tl.cdiv(K, GROUP) + g, scale)
    for k0 in range(start, end, BLOCK):
        kk = k0 + offs
        x = tl.load(x_ptr + row * x_stride + kk, mask=kk < end, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + kk, q.to(q_ptr.dtype.element_ty), mask=kk < end)


@triton.jit
def fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    s_stride,
    out_stride,
    GROUP_K,
    prefetch_programs,
    M_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCKED: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    GROUPS: tl.constexpr = 0,
    res_ptr=None,
    norm_w_ptr=None,
    eps=0.0,
    RMS: tl.constexpr = False,
    NORM_WEIGHT: tl.constexpr = False,
    ADD_RESIDUAL: tl.constexpr = False,
):
    # out[m, n] = sum_k x[m, k] * w[n, k] * scale: worker/gemv_kernels.py's small_linear_kernel over an
    # e4m3 weight (half the bytes), scaled per block of GROUP_K columns in the loop, or per row at the end.
    # GATED: w is [gate; up] of 2N rows and out is silu(gate) * up, as small_linear_kernel's. GROUPS (with
    # BLOCKED, BLOCK_K = GROUPS x GROUP_K): each step's GROUPS block scales a row loaded once and applied
    # to the step's per-group sums, not one scale loaded for every weight.
    # RMS (one row, M = 1): x is the residual stream h and out is the GEMV over its RMS norm, h * rstd * the
    # norm's weight (NORM_WEIGHT; without it the weight is folded into w). rstd is one factor of every
    # output, so the sum of squares rides along the loop that reads h anyway and rstd scales the sums at
    # the end: one pass, no launch of its own for the norm (where FlashInfer's norm takes rstd from the
    # float32 sum x + residual and rounds the normed row to x's dtype, this takes it from the stream as
    # the GEMV before rounded it, and rounds nothing before the product). ADD_RESIDUAL: out = (the
    # product, rounded to out's dtype) + res, as the residual add after this GEMV computes it, so the next
    # norm reads one row
    tl.static_assert(M_BLOCK == 1 or not (RMS or ADD_RESIDUAL), "the norm and the residual take one row")
    rn = gemv_rows(w_ptr, N, K, w_stride, prefetch_programs, BLOCK_N, PDL)
    if ADD_RESIDUAL:  # loaded before the loop, so its wait overlaps the weights'
        res = tl.load(res_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    rm = tl.arange(0, M_BLOCK)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride
    s_rows = s_ptr + rn[:, None] * s_stride
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = n_ok[:, None] & (kk[None, :] < K)
        w = tl.load(w_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(w_rows + tl.cast(N, tl.int64) * w_stride + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        if BLOCKED and GROUPS > 0:
            groups = k0 // GROUP_K + tl.arange(0, GROUPS)
            g_mask = n_ok[:, None] & (groups[None, :] < tl.cdiv(K, GROUP_K))
            sw = tl.load(s_rows + groups[None, :], mask=g_mask, other=0.0)
            if GATED:
                su = tl.load(s_rows + tl.cast(N, tl.int64) * s_stride + groups[None, :], mask=g_mask, other=0.0)
        elif BLOCKED:
            w = w * tl.load(s_rows + kk[None, :] // GROUP_K, mask=mask, other=0.0)
            if GATED:
                u = u * tl.load(s_rows + tl.cast(N, tl.int64) * s_stride + kk[None, :] // GROUP_K, mask=mask, other=0.0)
        for mi in tl.static_range(M_BLOCK):
            x = tl.load(x_ptr + tl.minimum(mi, M - 1) * x_stride + kk, mask=kk < K, other=0.0).to(tl.float32)
            if RMS:
                sq += x * x
                if NORM_WEIGHT:
                    x = x * tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            if BLOCKED and GROUPS > 0:
                acc += tl.where(rm[:, None] == mi, grouped_dot(w, x, sw, BLOCK_N, BLOCK_K, GROUPS)[None, :], 0.0)
                if GATED:
                    acc_up += tl.where(rm[:, None] == mi, grouped_dot(u, x, su, BLOCK_N, BLOCK_K, GROUPS)[None, :], 0.0)
            else:
                acc += tl.where(rm[:, None] == mi, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
                if GATED:
                    acc_up += tl.where(rm[:, None] == mi, tl.sum(u * x[None, :], axis=1)[None, :], 0.0)
    if not BLOCKED:
        acc = acc * tl.load(s_ptr + rn * s_stride, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_ptr + (rn + N) * s_stride, mask=n_ok, other=0.0)[None, :]
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
        acc = acc * rstd
        acc_up = acc_up * rstd
    if GATED:
        acc = silu_and_mul(acc, acc_up, out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + res[None, :]
    tl.store(
        out_ptr + rm[:, None] * out_stride + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & n_ok[None, :],
    )


@triton.jit
def grouped_dot(w, x, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    # sum_k w[n, k] x[k] scales[n, k's group] for a step of GROUPS groups of BLOCK_K / GROUPS columns
    parts = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, GROUPS, BLOCK_K // GROUPS)), axis=2)
    return tl.sum(parts * scales, axis=1)


@triton.jit
def rmsnorm_quant_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    K,
    eps,
    x_stride,
    res_stride,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program a row, two passes over it, as FlashInfer's fused add-and-norm computes it: s = x + residual
    # in float32 (written over the residual in x's dtype in the second pass), its RMS norm times the weight
    # from that float32 sum, rounded once to x's dtype as the norm writes it, and that row quantized to
    # e4m3 at one scale (its largest magnitude at 448), as quantize_groups_kernel quantizes the norm's
    # output. The first pass finds the sum of squares and the largest |s w| (times the row's 1/rms, a
    # positive factor, that is the normed row's largest magnitude), the second writes
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + offs
        ok = kk < K
        s = tl.load(x_ptr + row * x_stride + kk, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + row * res_stride + kk, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        sumsq += s * s
        peak = tl.maximum(peak, tl.abs(s * w))
    rrms = tl.math.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    amax = (tl.max(peak, axis=0) * rrms).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(amax / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        kk = k0 + offs
        ok = kk < K
        s = tl.load(x_ptr + row * x_stride + kk, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + row * res_stride + kk, mask=ok, other=0.0).to(tl.float32)
            tl.store(res_ptr + row * res_stride + kk, s.to(res_ptr.dtype.element_ty), mask=ok)
        w = tl.load(w_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        normed = (s * w * rrms).to(x_ptr.dtype.element_ty).to(tl.float32)
        q = tl.clamp(normed / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + kk, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def silu_quant_kernel(gu_ptr, q_ptr, s_ptr, inter, gu_stride, BLOCK: tl.constexpr):
    # one program a row of [gate | up], two passes: h = silu(gate) * up in float32, rounded to the input's
    # dtype as the unfused SiLU-and-multiply writes it, then quantized to e4m3 at the row's scale (its
    # largest magnitude at 448); the first pass finds that magnitude, the second writes
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    gate_row = gu_ptr + row * gu_stride
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        kk = k0 + offs
        ok = kk < inter
        g = tl.load(gate_row + kk, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_row + inter + kk, mask=ok, other=0.0).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g)) * u).to(gu_ptr.dtype.element_ty).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(h))
    scale = tl.maximum(tl.max(peak, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, inter, BLOCK):
        kk = k0 + offs
        ok = kk < inter
        g = tl.load(gate_row + kk, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_row + inter + kk, mask=ok, other=0.0).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g)) * u).to(gu_ptr.dtype.element_ty).to(tl.float32)
        q = tl.clamp(h / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * inter + kk, q.to(q_ptr.dtype.element_ty), mask=ok)
