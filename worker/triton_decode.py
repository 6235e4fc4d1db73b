"""Split-KV paged decode attention in Triton: one query token a request over a paged KV cache of float8
e4m3 (unscaled), bfloat16 or float16, laid out as FlashInfer's NHD pages and listed as FlashInfer's CSR
page lists. Every launch argument depends only on shapes and the caller's `num_splits`, so a CUDA graph
captured once replays over any lengths. On the CPU it runs only under Triton's interpreter (the tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from worker.pdl_kernels import await_previous
from worker.triton_ops import pdl_options

LOG2E = 1.4426950408889634
FP16_MAX = tl.constexpr(65504.0)
# Over an fp8 cache, convert each V block to float16 in registers before it is staged for the tensor cores
# (paged_decode's convert_v). The product P V sums over tokens, and V's bytes lie token after token: an e4m3
# V reaches the float16 operand's pairs of tokens one byte at a time from shared memory (in sm_90 code at
# batch 256, Qwen3-0.6B, the default tile: 128 LDS.U8 a thread a block, 2,144 SASS instructions in all);
# converted first it goes through ldmatrix's transposing load as float16 does (1,336 instructions, 189
# registers against 255, 104 KB of shared memory against 72). K stays e4m3 up to its operand, which it
# reaches 8 bytes at a time (its pairs are neighbours along head_dim). On an H100 (2026-12-05,
# bench/fp8_decode.py --variants): 191.7 us a layer at batch 256 against 197.9; (a) over fp8 28,444 and
# 27,840 output tok/s against 27,839 and 27,124 (medians of two runs, two calls). At batch 1 (32 splits) it
# was no faster (5.68 against 5.58 prefetching, 5.67 plain), and batch 8 was not timed: by default it applies
# at the tile it was measured at (paged_decode). Converting K first too was slower there (the variant that
# fa77bb8 removed: its float16 copy doubles K's shared memory)
CONVERT_V = True
# Merge a request's split results in the program of its last split to finish (paged_decode's merge_in_last)
# where a kv head has at most this many query heads: the count of a kv head's finished splits is an atomic
# in the scratch, and the merge's launch is gone. On an H100 (2026-12-06, bench/gpu.sh decode_merge, ms a
# token at batch 1): Qwen3-0.6B (2 query heads a kv head) 0.895 and 0.896 against 0.945 and 0.920 with the
# merge launched; Qwen3-8B with FP8 weights (4) 3.338 against 3.316 twice, where the last program's merge
# of 4 heads' 32 splits costs more than the launch; the kernel alone at Qwen3-0.6B's heads 5.26 against
# 5.79 us (fp8 cache, batch 1) and 5.59 against 5.77 (bf16). With the merge reading only the splits that
# hold tokens (6dc7148, another call): Qwen3-8B FP8 3.326 against 3.316, Qwen3-30B-A3B (8) 2.971 against 2.942
MERGE_IN_LAST_MAX_GROUP = 2


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr):
    # Triton's interpreter multiplies bfloat16 operands as their raw bits: there they go in as float32,
    # which holds them exactly (numpy accumulates in float32 as the tensor cores do)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _e4m3_to_f16(x):
    # e4m3 -> float16 four bytes at a time (two conversions of a byte pair each) where the values lie. Not pure
    # to the compiler on purpose: a pure conversion is moved past the change of layout to the tensor cores'
    # operand, and this one must stay before it (CONVERT_V)
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _cells(pages, t, end, PAGE_SIZE: tl.constexpr, stride_page, stride_tok, head):
    # each token's cell through the page table: right for any page size, within or across pages (t >= 0:
    # unsigned, so a power-of-two page size divides by a shift and a mask, without signed division's
    # fix-ups); and which of the block's tokens are the split's
    t_mask = t < end
    t_u = t.to(tl.uint32)
    page = tl.load(pages + t_u // PAGE_SIZE, mask=t_mask, other=0)
    return page.to(tl.int64) * stride_page + (t_u % PAGE_SIZE).to(tl.int32) * stride_tok + head, t_mask


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    last_page_len_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    F16_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    CUDA_CORES: tl.constexpr,
    PREFETCH: tl.constexpr,
    CONVERT_V: tl.constexpr,
    PDL: tl.constexpr,
    MERGE_IN_LAST: tl.constexpr = False,
    BLOCK_G: tl.constexpr = 1,
    order_ptr=None,
    ORDERED: tl.constexpr = False,
):
    # one program per (request, kv head, split): the group's query heads against the split's tokens,
    # with an online softmax in base 2 (qk_scale = sm_scale * log2(e)); one split writes `out` itself,
    # several write their normalized partial output and log2-sum-exp for _merge_kernel, or (MERGE_IN_LAST)
    # for the last of the request's kv head's splits to finish, which merges them itself
    await_previous(PDL)
    if ORDERED:
        # the grid is (kv head, split, rank) and rank i attends request order[i]: programs start in the
        # order of their linear index (kv head fastest, rank slowest), so with order longest first every
        # program of the longest request starts first (its splits are each as long as its others) and the
        # step ends on short ones, not on a long one started last
        kvh = tl.program_id(0)
        split = tl.program_id(1)
        b = tl.load(order_ptr + tl.program_id(2))
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
    first_page = tl.load(kv_indptr_ptr + b)
    num_pages = tl.load(kv_indptr_ptr + b + 1) - first_page
    seq_len = (num_pages - 1) * PAGE_SIZE + tl.load(last_page_len_ptr + b)
    # equal shares in whole blocks, so only a request's last block is partial; splits past its end
    # get no tokens (a request shorter than num_splits blocks leaves some empty)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    # the group's heads padded to BLOCK_H >= 16 rows: what tl.dot needs to run on tensor cores
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    if CUDA_CORES:
        # the group's few heads as products and sums in float32: no rows padded to 16, no operand
        # shuffles for the tensor cores; each K and V element converted once
        q = q.to(tl.float32)
    elif F16_DOT:
        # float16 operands: e4m3 converts to float16 directly, to bfloat16 only through it (so bfloat16
        # operands are slower). Every e4m3 value is exact in float16, and so is a
        # bfloat16 query from 2^-17 up to float16's range (saturated there)
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    pages = kv_indices_ptr + first_page
    head = kvh.to(tl.int64) * stride_kvh
    if PREFETCH:  # the first block's cells, before the loop
        row, t_mask = _cells(pages, start + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            # K and V of cells found the block before: no load in this block waits on another load of
            # it; the next block's page ids load while this one's computes
            k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
            v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
            mask = t_mask
            row, t_mask = _cells(pages, n0 + BLOCK_N + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
        else:
            this_row, mask = _cells(pages, n0 + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
            k = tl.load(k_ptr + this_row[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
        if CUDA_CORES:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * qk_scale
        else:
            qk = _mma(q, tl.trans(k.to(q.dtype)), UPCAST) * qk_scale
        qk = tl.where(mask[None, :], qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: every block holds a token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not PREFETCH:
            v = tl.load(v_ptr + this_row[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
        if CONVERT_V:
            v = _e4m3_to_f16(v)
        if CUDA_CORES:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v.to(q.dtype), UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None],
        )
    else:
        # an empty split: output 0 and lse -inf, which the merge weighs by exp2(-inf) = 0
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
        part = part_out_ptr + b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part[:, None] + offs_d[None, :], o, mask=h_mask[:, None])
        tl.store(part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)
        if MERGE_IN_LAST:
            # every warp's stores before the count (released with it, at the GPU's scope), as a semaphore's
            # release; the program that counts last sees every split's (acquired) and merges them, through L2
            tl.debug_barrier()
            slot = arrivals_ptr + b * num_kv_heads + kvh
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")  # counted from 0 again at the next launch
                # the kv head's query heads at once, split after split (unrolled): elementwise maxima,
                # weights and sums of rows loaded whole, so no step reduces across threads (each such
                # reduction would wait at a barrier, and the launch waits for this one program); loads
                # through L2 (.cg), where the other programs' stores are. Only the splits that hold tokens
                # are read (17 of 32 at 544 tokens in blocks of 32): an empty one weighs 0 and adds 0
                offs_g = tl.arange(0, BLOCK_G)
                g_mask = offs_g < GROUP
                q_heads = kvh * GROUP + offs_g
                lse_rows = part_lse_ptr + b.to(tl.int64) * stride_lb + q_heads * stride_lh
                used = tl.cdiv(seq_len, chunk)  # compared as a vector below: the interpreter masks with vectors only
                top = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
                for s in tl.static_range(NUM_SPLITS):
                    s_mask = g_mask & (offs_g * 0 + s < used)
                    top = tl.maximum(top, tl.load(lse_rows + s, mask=s_mask, other=-float("inf"), cache_modifier=".cg"))
                parts = part_out_ptr + b.to(tl.int64) * stride_pb + q_heads[:, None] * stride_ph + offs_d[None, :]
                merged = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
                total = tl.zeros([BLOCK_G], dtype=tl.float32)
                for s in tl.static_range(NUM_SPLITS):
                    s_mask = g_mask & (offs_g * 0 + s < used)
                    split_lse = tl.load(lse_rows + s, mask=s_mask, other=-float("inf"), cache_modifier=".cg")
                    w = tl.where(s_mask, tl.exp2(split_lse - top), 0.0)
                    merged += w[:, None] * tl.load(
                        parts + s * stride_ps, mask=s_mask[:, None], other=0.0, cache_modifier=".cg"
                    )
                    total += w
                tl.store(
                    out_ptr + b.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
                    (merged / total[:, None]).to(out_ptr.dtype.element_ty),
                    mask=g_mask[:, None],
                )


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program per (request, query head): the splits' outputs weighed by their share of the softmax
    # mass; a request's first split always holds a token, so the largest lse is finite
    await_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=-float("inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = part_out_ptr + b.to(tl.int64) * stride_pb + h * stride_ph
    o = tl.load(part + offs_s[:, None] * stride_ps + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


INTERPRETED = not isinstance(_split_kernel, triton.runtime.JITFunction)  # TRITON_INTERPRET=1 at Triton's import

KV_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16)
Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_SPLITS = 64


@dataclass
class DecodeScratch:
    """The split results of a launch: part_out [max_batch, num_heads, max_splits, head_dim] and part_lse
    [max_batch, num_heads, max_splits], float32, allocated once (a CUDA graph's launches reuse them);
    arrivals, int32 zeros of at least max_batch x num_kv_heads: how many of each request's kv head's splits
    have finished, for the merge in the last of them (each launch leaves them at zero again)."""

    part_out: torch.Tensor
    part_lse: torch.Tensor
    arrivals: torch.Tensor | None = None


def decode_scratch(
    max_batch_size: int, num_heads: int, head_dim: int, max_splits: int, device: torch.device | str
) -> DecodeScratch:
    """Scratch for any launch of up to max_batch_size requests and max_splits splits."""
    return DecodeScratch(
        torch.empty(max_batch_size, num_heads, max_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(max_batch_size, num_heads, max_splits, dtype=torch.float32, device=device),
        torch.zeros(max_batch_size * num_heads, dtype=torch.int32, device=device),  # num_kv_heads <= num_heads
    )


def decode_num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132, max_splits: int = 32) -> int:
    """Splits a request's KV for a batch: enough (request, kv head, split) programs to fill every
    multiprocessor about four times over (one split at batch 256 with 8 kv heads; max_splits at batch 1).
    Fixed by the batch size alone, so a CUDA graph of that size keeps it."""
    programs = max(batch_size * num_kv_heads, 1)
    return max(1, min(max_splits, math.ceil(4 * num_sms / programs)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    *,
    num_splits: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    scratch: DecodeScratch | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    f16_dot: bool | None = None,
    cuda_cores: bool = False,
    prefetch: bool | None = None,
    convert_v: bool | None = None,
    pdl: bool = False,
    merge_in_last: bool | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, num_heads, head_dim] (one token a request) over the pages of
    k_cache / v_cache [num_pages, page_size, num_kv_heads, head_dim]: request b reads pages
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]], the last of them filled to last_page_len[b] (int32 all).
    Returns [B, num_heads, head_dim] in q's dtype (into `out` when given). With `scratch` (from
    decode_scratch) and `out` it allocates nothing. The rest tune it (None: the fastest in bench/fp8_decode.py
    on an H200 or an H100): block_n, num_warps, num_stages, the tile (tokens a step) and launch shape; f16_dot, float16
    tensor-core operands (None: for an fp8 cache) or q's dtype; cuda_cores, the group's heads as float32
    products and sums instead of tensor-core tiles padded to 16 rows (for groups of a few heads); prefetch,
    each block's K and V loaded together from cells found the block before (no load waits on another; None:
    over an fp8 cache at a split or two a request); convert_v, an fp8 cache's V blocks converted to float16
    before the tensor cores' operand is staged, where those operands are float16 (None: CONVERT_V at the
    prefetching tile of a split or two a request, where it was measured; under the interpreter the plain
    conversion runs); pdl, both kernels launched with programmatic dependent launch
    (worker/pdl_kernels.py); merge_in_last, split results merged by the last of a request's kv head's splits
    to finish instead of a second launch (None: where a kv head has at most MERGE_IN_LAST_MAX_GROUP query
    heads; needs the scratch's arrivals); order, int32 [B] on q's device, a permutation of the requests (not
    checked: that would wait for the device) whose first ones are started first (`longest_first` of their
    lengths balances a batch of unequal lengths; the result is the same bit for bit in any order)."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    _check(q, k_cache, v_cache, num_splits)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if f16_dot is None:
        f16_dot = fp8
    tile = _default_tile(head_dim, num_splits, fp8)
    block_n, num_warps, num_stages = block_n or tile[0], num_warps or tile[1], num_stages or tile[2]
    if prefetch is None:
        prefetch = tile[3]
    float16_operands = fp8 and not cuda_cores and (f16_dot or q.dtype == torch.float16)
    if convert_v and not float16_operands:
        raise ValueError("convert_v converts an fp8 cache's V for float16 tensor-core operands only")
    if convert_v is None:  # where it was measured: the prefetching tile of a split or two a request
        convert_v = CONVERT_V and float16_operands and tile[3]
    if num_splits > 1:
        if scratch is None:
            scratch = decode_scratch(batch, num_heads, head_dim, num_splits, q.device)
        if scratch.part_out.shape[0] < batch or scratch.part_out.shape[2] < num_splits:
            raise ValueError(
                f"scratch for {scratch.part_out.shape[0]} requests and {scratch.part_out.shape[2]} "
                f"splits is too small for {batch} and {num_splits}"
            )
        part_out, part_lse = scratch.part_out, scratch.part_lse
        merge_in_last = group <= MERGE_IN_LAST_MAX_GROUP if merge_in_last is None else merge_in_last
        arrivals = scratch.arrivals if merge_in_last else part_lse  # unread without the merge in the last
        if merge_in_last and (arrivals is None or arrivals.numel() < batch * num_kv_heads):
            raise ValueError(f"merge_in_last needs the scratch's arrivals for {batch} x {num_kv_heads} kv heads")
    else:
        part_out, part_lse = out, out  # unread: one split writes out itself
        arrivals, merge_in_last = out, False
    if order is not None and (order.shape != (batch,) or order.dtype != torch.int32 or order.device != q.device):
        raise ValueError(
            f"order must be int32 [{batch}] on {q.device}, not {order.dtype} {list(order.shape)} on {order.device}"
        )
    grid = (num_kv_heads, num_splits, batch) if order is not None else (batch, num_kv_heads, num_splits)
    _split_kernel[grid](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        last_page_len,
        out,
        part_out,
        part_lse,
        arrivals,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        _stride(part_out, 2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(group) if cuda_cores else max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        F16_DOT=f16_dot,
        UPCAST=INTERPRETED,
        CUDA_CORES=cuda_cores,
        PREFETCH=prefetch,
        CONVERT_V=convert_v and not INTERPRETED,  # PTX: the interpreter runs the plain conversion
        PDL=pdl,
        MERGE_IN_LAST=merge_in_last,
        BLOCK_G=triton.next_power_of_2(group),
        order_ptr=order,
        ORDERED=order is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(pdl),
    )
    if num_splits > 1 and not merge_in_last:
        _merge_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            PDL=pdl,
            num_warps=4,
            **pdl_options(pdl),
        )
    return out


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """paged_decode's `order` for requests of these KV lengths: the longest first (ties in row order), int32.
    A batch's programs outnumber what the GPU holds at once several times over, and each new one starts
    where one finished: started in row order, a long request's programs may start last and keep a few
    multiprocessors busy after the others are idle; started longest first, the last to start are the
    shortest (longest-processing-time-first list scheduling)."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


def _default_tile(head_dim: int, num_splits: int, fp8: bool) -> tuple[int, int, int, bool]:
    """(block_n, num_warps, num_stages, prefetch), the fastest in bench/fp8_decode.py (head_dim 128, page 16):
    128 tokens a step at a split or two a request (batch 256), 32 where many splits leave each a few blocks
    (batch 1). Over an fp8 cache at batch 256 the prefetching variant with three stages took 184.7 us against
    208.5 for the plain kernel's two (the bf16 cache's variants were within 1% of each other; at batch 1 every
    variant was). Past head_dim 128, 32 (a guess: K and V tiles twice the size)."""
    if head_dim > 128 or num_splits > 2:
        return 32, 4, 2, False
    return (128, 4, 3, True) if fp8 else (128, 4, 2, False)


def _stride(x: torch.Tensor, dim: int) -> int:
    return x.stride(dim) if x.dim() > dim else 0


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_splits: int) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape, strides and dtype")
    if k_cache.dtype not in KV_DTYPES or q.dtype not in Q_DTYPES:
        raise ValueError(
            f"decode reads {KV_DTYPES} caches with bfloat16/float16 queries, not {k_cache.dtype} with {q.dtype}"
        )
    if k_cache.dtype != torch.float8_e4m3fn and k_cache.dtype != q.dtype:
        raise ValueError(f"a {k_cache.dtype} cache needs queries of the same dtype, not {q.dtype}")
    if k_cache.shape[3] != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(
            f"head_dim must be a power of two from 16 and match the cache's, not {head_dim} against {k_cache.shape[3]}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are no multiple of {num_kv_heads} kv heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q and the caches need unit stride along head_dim")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in 1..{MAX_SPLITS}, not {num_splits}")
    if not (q.is_cuda or INTERPRETED):
        raise ValueError(
            "paged_decode runs on CUDA tensors, or on the CPU under Triton's interpreter "
            "(TRITON_INTERPRET=1 before Triton is imported)"
        )


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """What paged_decode computes, in float32 torch, one request at a time (for the tests)."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    indptr, indices, last = kv_indptr.tolist(), kv_indices.long(), last_page_len.tolist()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        pages = indices[indptr[b] : indptr[b + 1]]
        n = (len(pages) - 1) * page_size + last[b]
        k, v = (_gather(c, pages).reshape(-1, num_kv_heads, head_dim)[:n] for c in (k_cache, v_cache))
        k, v = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))  # [n, num_heads, head_dim]
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    # float8 tensors lack gather kernels (on the CPU at least): move their bytes
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[pages].view(torch.float8_e4m3fn).float()
    return cache[pages].float()
