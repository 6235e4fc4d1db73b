"""The fused MoE path's kernels (a module of their own: importing it needs Triton): top-k routing, the sort
of (token, choice) rows by expert into blocks of BLOCK_M rows, each block one expert's, and the two
grouped GEMMs, where a program computes one (block, column tile), so every launch covers the selected
experts only. Routing and sorting are one launch each: as torch ops they were some thirty small kernels a
layer, more time than the GEMMs at batch 1. For a few tokens the per-row kernels skip the sort: a
matrix-vector product per (token, choice) row with the routing inside, then one per token with the
combine inside, two launches where the grouped path takes five."""

import triton
import triton.language as tl

from worker.pdl_kernels import await_previous


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # float32 stays float32 (Triton's default would round the inputs to tf32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# FP8 experts (SCALED): e4m3 weights [E, N, K] beside float32 scales [E, N, KG] (worker/quant/experts.py),
# weight (e, n, k) standing for e4m3 * scale[e, n, k // GROUP_K], or with GROUP_K 0 for e4m3 * scale[e, n, 0]
# (one group a row: per-channel scales, or a block wider than the rank's K). The activations stay in the
# model's dtype and the weights are widened to it in registers: the bytes a decode step reads halve, and
# the products are the dequantized weights' (the grouped GEMMs' and the down kernel's loop take K steps inside
# a group: the launcher caps BLOCK_K; the per-row gate-up and the at-once down kernel sum each group of a wider
# tile apart, _groups_summed and a reshape)


@triton.jit
def _scaled_dot(a, b, acc, s_ptrs, k0, n_ok, IEEE: tl.constexpr, SCALED: tl.constexpr, GROUP_K: tl.constexpr):
    # acc + a b for a [M, BLOCK_K] and b [BLOCK_K, N] tile starting at column k0 (s_ptrs: the N rows' scales).
    # A group's scales weigh b before the product (the weights it stands for, rounded to a's dtype as a
    # dequantized checkpoint's are): the accumulator stays in the tensor cores' chain (a product scaled
    # after it took 3.5x the time at 8,192 tokens on an H100)
    if not SCALED:
        return _dot(a, b, acc, IEEE)
    if GROUP_K == 0:
        return _dot(a, b.to(a.dtype), acc, IEEE)
    s = tl.load(s_ptrs + k0 // GROUP_K, mask=n_ok, other=0.0)
    return _dot(a, (b.to(tl.float32) * s[None, :]).to(a.dtype), acc, IEEE)


@triton.jit
def _group_scaled(part, s_ptrs, k0, n_ok, SCALED: tl.constexpr, GROUP_K: tl.constexpr):
    # a partial sum [..., N] over a tile of columns from k0 on, times its group's scales
    if SCALED and GROUP_K > 0:
        return part * tl.load(s_ptrs + k0 // GROUP_K, mask=n_ok, other=0.0)
    return part


@triton.jit
def _groups_summed(prod, s_ptrs, k0, width, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr):
    # prod [BLOCK_N, BLOCK_K] (columns k0 on of rows of `width` columns) summed over each group of GROUP_K
    # columns, each sum times its row's scale of that group, and those summed: [BLOCK_N]
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    sums = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, GROUP_K)), axis=2)
    groups = k0 // GROUP_K + tl.arange(0, GROUPS)
    ok = n_ok[:, None] & (groups < tl.cdiv(width, GROUP_K))[None, :]
    return tl.sum(sums * tl.load(s_ptrs[:, None] + groups[None, :], mask=ok, other=0.0), axis=1)


@triton.jit
def _row_scaled(acc, s_ptrs, n_ok, SCALED: tl.constexpr, GROUP_K: tl.constexpr):
    # acc [..., N] times its rows' one scale, where the scales are a row's (GROUP_K 0)
    if SCALED and GROUP_K == 0:
        return acc * tl.load(s_ptrs, mask=n_ok, other=0.0)
    return acc


# W8A8 (the grouped GEMMs over experts with a scale a row: fused.w8a8_applies): the activations come quantized
# to e4m3 too, with float32 scales [rows, KG] of the same groups as the weights' (a row's one scale with
# GROUP_K 0), and the products run on the FP8 tensor cores at twice bf16's rate (on sm_90 with Triton's
# default fast accumulation, as the dense FP8 GEMMs' cuBLASLt), where widening the weights made a
# compute-bound chunk slower than bf16


@triton.jit
def _w8a8_dot(a, b, acc, as_ptrs, s_ptrs, k0, m_ok, n_ok, GROUP_K: tl.constexpr):
    # acc + a b over e4m3 tiles. A scale a row each: the product accumulates as it is and _w8a8_scaled
    # applies both at the end; a group each: each K step (inside one group) weighed by its pair of scales
    if GROUP_K == 0:
        return tl.dot(a, b, acc)
    a_s = tl.load(as_ptrs + k0 // GROUP_K, mask=m_ok, other=0.0)
    b_s = tl.load(s_ptrs + k0 // GROUP_K, mask=n_ok, other=0.0)
    return acc + tl.dot(a, b) * a_s[:, None] * b_s[None, :]


@triton.jit
def _w8a8_scaled(acc, as_ptrs, s_ptrs, m_ok, n_ok, GROUP_K: tl.constexpr):
    if GROUP_K == 0:
        a_s = tl.load(as_ptrs, mask=m_ok, other=0.0)
        return acc * a_s[:, None] * tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit(do_not_specialize=["num_rows"])  # one variant a tile, whatever the row count
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    s_ptr,
    stride_se,
    stride_sn,
    as_ptr,
    stride_as,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_K: tl.constexpr,
    W8A8: tl.constexpr = False,
):
    # out[r] = silu(x[t] gate_e^T) * (x[t] up_e^T) for each (token t, choice k) row r = t * TOP_K + k; SCALED:
    # e4m3 weights times their scales (_scaled_dot); W8A8: x is e4m3 too, its scales as_ptr's [T, KG]
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    tokens = rows // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    sg_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    su_ptrs = sg_ptrs + inter * stride_sn
    as_ptrs = as_ptr + tokens * stride_as
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W8A8:
            acc_g = _w8a8_dot(a, g, acc_g, as_ptrs, sg_ptrs, k * BLOCK_K, row_ok, n_ok, GROUP_K)
            acc_u = _w8a8_dot(a, u, acc_u, as_ptrs, su_ptrs, k * BLOCK_K, row_ok, n_ok, GROUP_K)
        else:
            acc_g = _scaled_dot(a, g, acc_g, sg_ptrs, k * BLOCK_K, n_ok, IEEE, SCALED, GROUP_K)
            acc_u = _scaled_dot(a, u, acc_u, su_ptrs, k * BLOCK_K, n_ok, IEEE, SCALED, GROUP_K)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W8A8:
        acc_g = _w8a8_scaled(acc_g, as_ptrs, sg_ptrs, row_ok, n_ok, GROUP_K)
        acc_u = _w8a8_scaled(acc_u, as_ptrs, su_ptrs, row_ok, n_ok, GROUP_K)
    else:
        acc_g = _row_scaled(acc_g, sg_ptrs, n_ok, SCALED, GROUP_K)
        acc_u = _row_scaled(acc_u, su_ptrs, n_ok, SCALED, GROUP_K)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])  # one variant a tile, whatever the row count
def moe_down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    s_ptr,
    stride_se,
    stride_sn,
    as_ptr,
    stride_as,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_K: tl.constexpr,
    W8A8: tl.constexpr = False,
):
    # out[r] = weights[r] * (h[r] down_e^T): each row's expert output, already scaled by its routing weight;
    # W8A8: h is e4m3, its scales as_ptr's [rows, KG]
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    as_ptrs = as_ptr + rows * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W8A8:
            acc = _w8a8_dot(a, b, acc, as_ptrs, s_ptrs, k * BLOCK_K, row_ok, n_ok, GROUP_K)
        else:
            acc = _scaled_dot(a, b, acc, s_ptrs, k * BLOCK_K, n_ok, IEEE, SCALED, GROUP_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if W8A8:
        acc = _w8a8_scaled(acc, as_ptrs, s_ptrs, row_ok, n_ok, GROUP_K)
    else:
        acc = _row_scaled(acc, s_ptrs, n_ok, SCALED, GROUP_K)
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _top_k(
    logits_ptr,
    t,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    COPIES: tl.constexpr,
):
    # token t's softmax over the experts in float32, then its top k: (weights, ids) [K_P2]. Routing is on
    # batch 1's critical path (every per-row program routes before its first weight load), so it is kept
    # to reductions inside a warp: each of the program's COPIES warps (pass its num_warps) routes a copy of
    # the logits, [COPIES, E_P2] laid out a row a warp, and the copies meet once at the end (a max over
    # the copies: 6 barriers a program in sm_90's code, where one row over all warps took 29). Each
    # expert's key packs its probability's bits (a non-negative float orders as its bits do) above its
    # index reversed: one integer max a choice finds the largest probability and, among equal ones, the
    # lowest expert (a max and an argmax a choice took twice the reductions)
    offs = tl.arange(0, E_P2)[None, :] + tl.zeros((COPIES, 1), dtype=tl.int32)
    valid = offs < num_experts
    x = tl.load(logits_ptr + t * stride_logits + offs, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (E_P2 - 1 - offs), -1)
    k_offs = tl.arange(0, K_P2)
    top_key = tl.zeros((COPIES, K_P2), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, 1)
        top_key = tl.where(k_offs[None, :] == k, best[:, None], top_key)
        keys = tl.where(keys == best[:, None], -1, keys)
    top_key = tl.max(top_key, 0)
    top_i = (E_P2 - 1 - (top_key & (E_P2 - 1))).to(tl.int32)
    top_w = (top_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    top_w = tl.where(k_offs < TOP_K, top_w, 0.0)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    return top_w, top_i


@triton.jit
def moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    COPIES: tl.constexpr,
):
    # one program per token
    t = tl.program_id(0).to(tl.int64)
    top_w, top_i = _top_k(logits_ptr, t, num_experts, stride_logits, TOP_K, K_P2, E_P2, RENORMALIZE, COPIES)
    k_offs = tl.arange(0, K_P2)
    k_ok = k_offs < TOP_K
    tl.store(weights_ptr + t * TOP_K + k_offs, top_w.to(weights_ptr.dtype.element_ty), mask=k_ok)
    tl.store(ids_ptr + t * TOP_K + k_offs, top_i.to(ids_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def moe_row_gate_up_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    hidden,
    inter,
    stride_x,
    stride_logits,
    stride_we,
    stride_wn,
    stride_h,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUTE: tl.constexpr,
    COPIES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    # the per-row path of a few tokens (decode at small batch): one program per ((token, choice) row r,
    # column tile), a matrix-vector product over its expert's gate and up rows, h[r] = silu(x g^T) * (x u^T).
    # With ROUTE the program picks its row's expert from the logits itself (the route kernel's choice,
    # recomputed: 128 logits cost less than a launch) and tile 0 stores it and its weight for the down pass.
    # Its weights follow from the routing, so there is nothing to prefetch before the wait
    await_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    t = r // TOP_K
    if ROUTE:
        top_w, top_i = _top_k(logits_ptr, t, num_experts, stride_logits, TOP_K, K_P2, E_P2, RENORMALIZE, COPIES)
        mine = tl.arange(0, K_P2) == r % TOP_K
        expert = tl.sum(tl.where(mine, top_i, 0), 0)
        if pid_n == 0:
            tl.store(weights_ptr + r, tl.sum(tl.where(mine, top_w, 0.0), 0).to(weights_ptr.dtype.element_ty))
            tl.store(ids_ptr + r, expert.to(ids_ptr.dtype.element_ty))
    else:
        expert = tl.load(ids_ptr + r)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    sg_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
    su_ptrs = sg_ptrs + inter * stride_sn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        xv = tl.load(x_ptr + t * stride_x + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        if SCALED and GROUP_K > 0 and BLOCK_K > GROUP_K:  # a tile over several groups: a sum a group first
            acc_g += _groups_summed(g * xv[None, :], sg_ptrs, k0, hidden, n_ok, BLOCK_N, BLOCK_K, GROUP_K)
            acc_u += _groups_summed(u * xv[None, :], su_ptrs, k0, hidden, n_ok, BLOCK_N, BLOCK_K, GROUP_K)
        else:
            acc_g += _group_scaled(tl.sum(g * xv[None, :], axis=1), sg_ptrs, k0, n_ok, SCALED, GROUP_K)
            acc_u += _group_scaled(tl.sum(u * xv[None, :], axis=1), su_ptrs, k0, n_ok, SCALED, GROUP_K)
    acc_g = _row_scaled(acc_g, sg_ptrs, n_ok, SCALED, GROUP_K)
    acc_u = _row_scaled(acc_u, su_ptrs, n_ok, SCALED, GROUP_K)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + r * stride_h + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_row_down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    ids_ptr,
    hidden,
    inter,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_P2: tl.constexpr,
    AT_ONCE: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    # the per-row path's second half: one program per (token, column tile) sums its TOP_K rows' expert
    # outputs, each scaled by its routing weight, in float32: the combine needs no launch of its own
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    if AT_ONCE:
        # inter <= BLOCK_K: every choice's expert id, rows of h and weight tile loaded at once (one wait on
        # memory a program, where the other branch waits twice a choice: for its id, then for its weights)
        offs_c = tl.arange(0, K_P2)
        c_ok = offs_c < TOP_K
        r = t * TOP_K + offs_c
        experts = tl.load(ids_ptr + r, mask=c_ok, other=0).to(tl.int64)
        route_w = tl.load(weights_ptr + r, mask=c_ok, other=0.0).to(tl.float32)
        s_ptrs = s_ptr + experts[:, None] * stride_se + offs_n[None, :].to(tl.int64) * stride_sn
        cn_ok = c_ok[:, None] & n_ok[None, :]
        k_ok = offs_k < inter
        hv = tl.load(h_ptr + r[:, None] * stride_h + offs_k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0).to(
            tl.float32
        )
        b = tl.load(
            w_ptr
            + experts[:, None, None] * stride_we
            + offs_n[None, :, None].to(tl.int64) * stride_wn
            + offs_k[None, None, :],
            mask=cn_ok[:, :, None] & k_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        prod = b * hv[:, None, :]
        if SCALED and GROUP_K > 0:  # FP8 scales that change along K: a sum a group, times its scale
            GROUPS: tl.constexpr = BLOCK_K // GROUP_K
            sums = tl.sum(tl.reshape(prod, (K_P2, BLOCK_N, GROUPS, GROUP_K)), axis=3)
            groups = tl.arange(0, GROUPS)
            ok = cn_ok[:, :, None] & (groups < tl.cdiv(inter, GROUP_K))[None, None, :]
            acc3 = tl.sum(sums * tl.load(s_ptrs[:, :, None] + groups[None, None, :], mask=ok, other=0.0), axis=2)
        else:
            acc3 = _row_scaled(tl.sum(prod, axis=2), s_ptrs, cn_ok, SCALED, GROUP_K)  # [K_P2, BLOCK_N]
        acc = tl.sum(acc3 * route_w[:, None], axis=0)
    else:
        # every choice's products summed in a tile, reduced across the warps once at the end: no barrier
        # between one choice's loads and the next's (26 a program in sm_90's code at the default tile, now
        # 4). Each choice still waits for its id, then its weights; the at-once variant waits once
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            r = t * TOP_K + k
            expert = tl.load(ids_ptr + r).to(tl.int64)
            route_w = tl.load(weights_ptr + r).to(tl.float32)
            b_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            s_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
            for k0 in range(0, inter, BLOCK_K):
                k_ok = offs_k < inter - k0
                hv = tl.load(h_ptr + r * stride_h + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                b = tl.load(b_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                if SCALED:  # each row's scale (its one, or this tile's group's) weighs its products here
                    s = tl.zeros((BLOCK_N,), dtype=tl.float32) + route_w  # a vector, as the helpers return
                    s = _row_scaled(_group_scaled(s, s_ptrs, k0, n_ok, SCALED, GROUP_K), s_ptrs, n_ok, SCALED, GROUP_K)
                    acc2 += b * hv[None, :] * s[:, None]
                else:
                    acc2 += b * (hv * route_w)[None, :]
        acc = tl.sum(acc2, axis=1)
    tl.store(out_ptr + t * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["rows", "num_slots", "num_blocks"])  # one variant a tile, whatever the row count
def moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    scratch_ptr,
    rows,
    num_experts,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_P2: tl.constexpr,
    FILL: tl.constexpr,
):
    # one program, rows taken CHUNK at a time: each row's rank among its expert's rows is what the atomic
    # count returns (in no set order: the GEMMs compute each row alone, so a row's place in its expert's
    # blocks changes none of its bits), then each expert's padded start (a cumsum), then each row goes to
    # start + rank. Barriers order the phases. scratch: counts [E_P2], padded starts [E_P2], ranks [rows]
    e_offs = tl.arange(0, E_P2)
    tl.store(scratch_ptr + e_offs, tl.zeros((E_P2,), dtype=tl.int32))
    for start in range(0, num_slots, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + o, tl.full((FILL,), 0, tl.int32) + rows, mask=o < num_slots)
    for start in range(0, num_blocks, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + o, tl.full((FILL,), -1, tl.int32), mask=o < num_blocks)
    tl.debug_barrier()
    ranks_ptr = scratch_ptr + 2 * E_P2
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < rows
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        rank = tl.atomic_add(scratch_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=valid)
        tl.store(ranks_ptr + offs, rank, mask=valid)
    tl.debug_barrier()
    counts = tl.load(scratch_ptr + e_offs, mask=e_offs < num_experts, other=0, volatile=True)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(scratch_ptr + E_P2 + e_offs, tl.cumsum(padded, 0) - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < rows
        expert = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        rank = tl.load(ranks_ptr + offs, mask=valid, other=0, volatile=True)
        dest = tl.load(scratch_ptr + E_P2 + expert, mask=valid, other=0, volatile=True) + rank
        tl.store(sorted_ids_ptr + dest, offs, mask=valid)
        tl.store(expert_ids_ptr + dest // BLOCK_M, expert, mask=valid)
