"""Triton kernels of worker/gemv.py (a module of their own: Triton's interpreter patches `tl` in the
kernels' module globals, and importing this needs Triton)."""

import triton
import triton.language as tl

from worker.pdl_kernels import gemv_rows


@triton.jit
def small_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    out_stride,
    prefetch_programs,
    M_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    # out[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (decode at small batch): one program per
    # BLOCK_N output columns, reading its weight rows once for every m, accumulating in float32. GATED: w
    # is [gate; up] of 2N rows and out[m, n] = silu(gate row n's product) * (up row n's product), each
    # rounded to out's dtype first as the unfused GEMV writes them (the SiLU in the GEMV's epilogue)
    rn = gemv_rows(w_ptr, N, K, w_stride, prefetch_programs, BLOCK_N, PDL)
    rm = tl.arange(0, M_BLOCK)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = (rn[:, None] < N) & (kk[None, :] < K)
        w = tl.load(w_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(w_rows + tl.cast(N, tl.int64) * w_stride + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        for mi in tl.static_range(M_BLOCK):
            x = tl.load(x_ptr + tl.minimum(mi, M - 1) * x_stride + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += tl.where(rm[:, None] == mi, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
            if GATED:
                acc_up += tl.where(rm[:, None] == mi, tl.sum(u * x[None, :], axis=1)[None, :], 0.0)
    if GATED:
        acc = silu_and_mul(acc, acc_up, out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rm[:, None] * out_stride + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def silu_and_mul(gate, up, dtype: tl.constexpr):
    # silu(gate) * up in float32 from both rounded to dtype, as SiLU-and-multiply computes it from the
    # gate-up GEMV's output (the result is rounded by the caller's store)
    g = gate.to(dtype).to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * up.to(dtype).to(tl.float32)


@triton.jit
def norm_linear_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    normed_ptr,
    N,
    K,
    w_stride,
    eps,
    s_ptr,
    s_stride,
    GROUP_K,
    prefetch_programs,
    HAS_RES: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCKED: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    # out = rmsnorm(x + res) @ w.T for one row (batch-1 decode), the residual norm and the GEMV in one
    # launch. Each program computes the norm of the whole row itself (a few KiB read from L2) and then
    # BLOCK_N output columns; program 0 also writes the new residual (x + res) and, with WRITE_NORMED,
    # the normed row. As FlashInfer's norms: the sum in float32, normed = (x + res) * rstd * weight,
    # rounded to the row's dtype before the product, as the GEMV after a separate norm reads it. SCALED:
    # w is e4m3 with a scale a row (s [N]) applied to the sums, or with BLOCKED one a row and block of
    # GROUP_K columns (s [N, K / GROUP_K]) applied to the weights, as the FP8 GEMV scales them. GATED: w
    # is [gate; up] of 2N rows and out silu(gate row's product) * (up row's), as small_linear_kernel's
    rn = gemv_rows(w_ptr, N, K, w_stride, prefetch_programs, BLOCK_N, PDL)
    rk = tl.arange(0, BLOCK_K)
    first = (rk * 0 + tl.program_id(0)) == 0  # program 0's lanes (the interpreter masks with vectors only)
    if ONE_BLOCK:
        # K <= BLOCK_K: the row, the norm's weight and the program's weight rows loaded at once, before the
        # norm's sum (which the weight loads do not need), so the program waits on memory once, not twice
        km = rk < K
        h = tl.load(x_ptr + rk, mask=km, other=0.0).to(tl.float32)
        if HAS_RES:
            h += tl.load(res_ptr + rk, mask=km, other=0.0).to(tl.float32)
        nw = tl.load(norm_w_ptr + rk, mask=km, other=0.0).to(tl.float32)
        mask = (rn[:, None] < N) & km[None, :]
        w = weight_rows(w_ptr, w_stride, s_ptr, s_stride, GROUP_K, rn, rk, mask, BLOCKED)
        if GATED:
            u = weight_rows(w_ptr, w_stride, s_ptr, s_stride, GROUP_K, rn + N, rk, mask, BLOCKED)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
        if HAS_RES:
            tl.store(res_out_ptr + rk, h.to(res_out_ptr.dtype.element_ty), mask=km & first)
        normed = (h * rstd * nw).to(x_ptr.dtype.element_ty)
        if WRITE_NORMED:
            tl.store(normed_ptr + rk, normed, mask=km & first)
        acc = tl.sum(w * normed.to(tl.float32)[None, :], axis=1)
        if GATED:
            acc_up = tl.sum(u * normed.to(tl.float32)[None, :], axis=1)
    else:
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            h = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            if HAS_RES:
                h += tl.load(res_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            km = kk < K
            h = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            if HAS_RES:
                h += tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)
                tl.store(res_out_ptr + kk, h.to(res_out_ptr.dtype.element_ty), mask=km & first)
            nw = tl.load(norm_w_ptr + kk, mask=km, other=0.0).to(tl.float32)
            normed = (h * rstd * nw).to(x_ptr.dtype.element_ty)
            if WRITE_NORMED:
                tl.store(normed_ptr + kk, normed, mask=km & first)
            mask = (rn[:, None] < N) & km[None, :]
            w = weight_rows(w_ptr, w_stride, s_ptr, s_stride, GROUP_K, rn, kk, mask, BLOCKED)
            acc += tl.sum(w * normed.to(tl.float32)[None, :], axis=1)
            if GATED:
                u = weight_rows(w_ptr, w_stride, s_ptr, s_stride, GROUP_K, rn + N, kk, mask, BLOCKED)
                acc_up += tl.sum(u * normed.to(tl.float32)[None, :], axis=1)
    if SCALED and not BLOCKED:
        acc = acc * tl.load(s_ptr + rn * s_stride, mask=rn < N, other=0.0)
        if GATED:
            acc_up = acc_up * tl.load(s_ptr + (rn + N) * s_stride, mask=rn < N, other=0.0)
    if GATED:
        acc = silu_and_mul(acc, acc_up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def weight_rows(w_ptr, w_stride, s_ptr, s_stride, GROUP_K, rows, kk, mask, BLOCKED: tl.constexpr):
    # rows `rows` of w at columns kk in float32, scaled where w is scaled a row and block of GROUP_K columns
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_stride + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    if BLOCKED:
        w = w * tl.load(s_ptr + rows[:, None] * s_stride + kk[None, :] // GROUP_K, mask=mask, other=0.0)
    return w


@triton.jit
def silu_linear_kernel(
    gate_up_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    w_stride,
    prefetch_programs,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # out = (silu(gate) * up) @ w.T for one row, gate_up = [gate | up] of K each: SiLU-and-multiply and
    # the down projection's GEMV in one launch. The product is rounded to the row's dtype before the
    # GEMV, as it is when a separate kernel writes it.
    rn = gemv_rows(w_ptr, N, K, w_stride, prefetch_programs, BLOCK_N, PDL)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        km = kk < K
        g = tl.load(gate_up_ptr + kk, mask=km, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + K + kk, mask=km, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g)) * u).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * w_stride + kk[None, :],
            mask=(rn[:, None] < N) & km[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * act[None, :], axis=1)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
