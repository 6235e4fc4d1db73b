"""The Triton kernel of worker/skinny_gemm.py (a module of its own: importing it needs Triton)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])  # one variant a tile, whatever the row count
def skinny_mm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    a_stride,
    as_stride,
    b_stride,
    bs_stride,
    c_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALES: tl.constexpr,
    SPLIT: tl.constexpr,
    M_FIRST: tl.constexpr,
):
    # c = a @ b.T over a [M, K] and b [N, K] of one dtype (bf16, fp16 or e4m3), summed in float32: one
    # program per [BLOCK_M, BLOCK_N] tile of c and per split of K. SCALES: 0 none; 1 a's per row [M] and b's
    # per column [N], applied once at the end; 2 a's [M, K / BLOCK_K] and b's [N, K / BLOCK_K] (BLOCK_K is
    # the scales' group, so each step's dot has one scale pair) applied step by step. SPLIT: K split over
    # the grid's second axis (the count of splits is not a compile of its own); each program writes its
    # partial tile to part [splits, M, N] and counts itself in count[tile], and the last to arrive adds the
    # partials in the order of K (its own too, read back), so the sum does not depend on which program came
    # last, writes c and resets the count for the next launch
    # the grid: (N tiles, splits, M tiles), or with M_FIRST (M tiles, splits, N tiles), so that programs
    # launched together share their weight tile (prompt chunks: the weight is read once from memory, the
    # activations' tiles from L2) rather than their rows
    pid_n = tl.program_id(2) if M_FIRST else tl.program_id(0)
    pid_m = tl.program_id(0) if M_FIRST else tl.program_id(2)
    n_tiles = tl.num_programs(2) if M_FIRST else tl.num_programs(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * a_stride
    b_rows = b_ptr + rn[None, :].to(tl.int64) * b_stride
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, splits)
    first = split * per_split
    last = tl.minimum(first + per_split, steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(first, last):
        kk = j * BLOCK_K + rk
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == 2:
            a_s = tl.load(as_ptr + rm * as_stride + j, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptr + rn * bs_stride + j, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
    tile = rm[:, None].to(tl.int64) * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        plane = tl.cast(M, tl.int64) * N  # one split's partials
        tl.store(part_ptr + split * plane + tile, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        arrived = tl.atomic_add(count_ptr + pid_m * n_tiles + pid_n, 1, sem="acq_rel")
        if arrived == splits - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(splits):
                # past L1, which may hold this address from an earlier launch
                acc += tl.load(part_ptr + s * plane + tile, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_m * n_tiles + pid_n, 0)
            _store_scaled(acc, as_ptr, bs_ptr, c_ptr, rm, rn, m_ok, n_ok, as_stride, bs_stride, c_stride, SCALES)
    else:
        _store_scaled(acc, as_ptr, bs_ptr, c_ptr, rm, rn, m_ok, n_ok, as_stride, bs_stride, c_stride, SCALES)


@triton.jit
def _store_scaled(acc, as_ptr, bs_ptr, c_ptr, rm, rn, m_ok, n_ok, as_stride, bs_stride, c_stride, SCALES: tl.constexpr):
    if SCALES == 1:
        acc = acc * tl.load(as_ptr + rm * as_stride, mask=m_ok, other=0.0)[:, None]
        acc = acc * tl.load(bs_ptr + rn * bs_stride, mask=n_ok, other=0.0)[None, :]
    tl.store(
        c_ptr + rm[:, None].to(tl.int64) * c_stride + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )
