"""Split-KV paged decode attention in Triton: one query token a request over a paged KV cache of float8
e4m3 (unscaled), bfloat16 or float16, laid out as FlashInfer's NHD pages and listed as FlashInfer's CSR
page lists. Every launch argument depends only on shapes and the caller's `num_splits`, so a CUDA graph
captured once replays over any lengths. On the CPU it runs only under Triton's interpreter (the tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
# Over an fp8 cache, the products on the FP8 tensor cores (paged_decode's fp8_mma): 1, Q K^T with the query
# quantized to e4m3 (a scale a head) over K as the cache holds it, P V in float16; 2, P V too with P in e4m3.
# 0 (neither) until measured (bench/fp8_decode.py --variants)
FP8_MMA = 0
# The products transposed, tokens as their rows (paged_decode's token_rows), over any cache: what fp8_mma takes,
# and over a half-precision cache the same products in its dtype on Hopper's wgmma instead of mma.sync. Off
# until measured
TOKEN_ROWS = False


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, FP8: tl.constexpr = False):
    # Triton's interpreter multiplies bfloat16 operands as their raw bits: there they go in as float32,
    # which holds them exactly (numpy accumulates in float32 as the tensor cores do). FP8 (e4m3 operands):
    # Hopper's FP8 products add into their accumulator at reduced precision, and Triton's default on sm_90
    # never promotes it, where the P V sum, folded into the product's accumulator, runs the whole context
    # long: promoted to float32 every 32 of K (each wgmma's own K)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if FP8:
        return tl.dot(a, b, max_num_imprecise_acc=32)
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
def _to_e4m3(x, INTERPRETED: tl.constexpr):
    # x (within e4m3's range) rounded to e4m3. Triton's interpreter rounds a value just below a power of two
    # to half that power (7.95 to 4, not 8): there the power is put back (its subnormals stay off by up to
    # 2^-9, a bound far inside the tests' own)
    y = x.to(tl.float8e4nv)
    if INTERPRETED:
        yf = y.to(tl.float32)
        y = tl.where(tl.abs(yf) < 0.75 * tl.abs(x), 2.0 * yf, yf).to(tl.float8e4nv)
    return y


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
def _kv(k_ptr, v_ptr, row, mask, offs_d):
    # a block's K and V at its tokens' cells (PREFETCH: cells found the block before, so no load in this block
    # waits on another load of it, and the next block's page ids load while this one's computes)
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    return k, v


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
    FP8_MMA: tl.constexpr = 0,
    TOKEN_ROWS: tl.constexpr = False,
):
    # one program per (request, kv head, split): the group's query heads against the split's tokens,
    # with an online softmax in base 2 (qk_scale = sm_scale * log2(e)); one split writes `out` itself,
    # several write their normalized partial output and log2-sum-exp for _merge_kernel, or (MERGE_IN_LAST)
    # for the last of the request's kv head's splits to finish, which merges them itself
    await_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    q_in = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    q = q_in
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
    pages = kv_indices_ptr + first_page
    head = kvh.to(tl.int64) * stride_kvh
    if PREFETCH:  # the first block's cells, before the loop
        row, t_mask = _cells(pages, start + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
    if TOKEN_ROWS:
        # the products transposed, S^T = K Q^T and O^T = V^T P^T: tokens are their M side (BLOCK_N >= 64 rows, what
        # Hopper's wgmma needs) and the group's heads the N side (16), so K and V go to the tensor cores from
        # shared memory as the cache holds them, with no rows of heads padded to wgmma's 64. Over a
        # half-precision cache in its dtype, as the default's products. FP8_MMA (an fp8 cache): 1, Q K^T in e4m3,
        # the query rounded a head at a time (its largest magnitude at 448, the scale applied to the logits),
        # over K unconverted, P V in float16; 2, P V in e4m3 too, P times 448 (divided out at the end)
        if FP8_MMA:
            qf = q_in.to(tl.float32)  # as loaded: float16's range and precision do not bound it
            q_scale = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30) / 448.0
            q_t = tl.trans(_to_e4m3(qf / q_scale[:, None], UPCAST))  # [HEAD_DIM, BLOCK_H]
            col_scale = q_scale * qk_scale
        else:
            q_t = tl.trans(q)
            col_scale = tl.full([BLOCK_H], qk_scale, dtype=tl.float32)
        acc_t = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                k, v = _kv(k_ptr, v_ptr, row, t_mask, offs_d)
                mask = t_mask
                row, t_mask = _cells(pages, n0 + BLOCK_N + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
            else:
                this_row, mask = _cells(pages, n0 + offs_n, end, PAGE_SIZE, stride_page, stride_tok, head)
                k, v = _kv(k_ptr, v_ptr, this_row, mask, offs_d)
            s_t = _mma(k.to(q_t.dtype), q_t, UPCAST, FP8_MMA > 0) * col_scale[None, :]  # [BLOCK_N, BLOCK_H]
            s_t = tl.where(mask[:, None], s_t, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p_t = tl.exp2(s_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p_t, axis=0)
            if FP8_MMA == 2:
                pv = _mma(tl.trans(v), _to_e4m3(p_t * 448.0, UPCAST), UPCAST, True)
            else:
                pv = _mma(tl.trans(v.to(q.dtype)), p_t.to(q.dtype), UPCAST)
            acc_t = acc_t * alpha[None, :] + pv
            m_i = m_new
        acc = tl.trans(acc_t)
        if FP8_MMA == 2:
            acc = acc / 448.0
    else:
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                k, v = _kv(k_ptr, v_ptr, row, t_mask, offs_d)
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
            slot = arrivals_ptr + b * tl.num_programs(1) + kvh
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
    fp8_mma: int | None = None,
    token_rows: bool | None = None,
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
    heads; needs the scratch's arrivals); fp8_mma, over an fp8 cache the products on FP8 tensor cores with
    tokens as their rows: 1, Q K^T with the query in e4m3 (a scale a head) over K unconverted; 2, P V too, P
    in e4m3 (None: FP8_MMA on GPUs of compute capability 9.0, wgmma's; block_n of 64 or more); token_rows, the
    products transposed, tokens as their rows (what fp8_mma takes; None: TOKEN_ROWS, or fp8_mma)."""
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
    # what the transposed products' defaults leave alone: the variants and tiles asked of the other layout
    rows_fit = token_rows is not False and not cuda_cores and not convert_v and (block_n or 64) >= 64
    if fp8_mma is None:
        fp8_mma = FP8_MMA if FP8_MMA and fp8 and rows_fit and _fp8_tensor_cores(q) else 0  # no device query when off
    elif fp8_mma not in (0, 1, 2):
        raise ValueError(f"fp8_mma is 0, 1 (Q K^T on FP8 tensor cores) or 2 (P V too), not {fp8_mma}")
    elif fp8_mma and (not fp8 or cuda_cores or not _fp8_tensor_cores(q)):
        raise ValueError("fp8_mma multiplies an fp8 cache on FP8 tensor cores (compute capability 9.0+) only")
    if token_rows is None:
        token_rows = bool(fp8_mma) or (TOKEN_ROWS and rows_fit)
    elif fp8_mma and not token_rows:
        raise ValueError("fp8_mma's products take tokens as their rows: token_rows cannot be off with it")
    elif token_rows and cuda_cores:
        raise ValueError("token_rows transposes the tensor cores' products: not with cuda_cores")
    if token_rows and convert_v:
        raise ValueError("convert_v stages V for the products with heads as rows: not with token_rows")
    if token_rows and block_n is not None and block_n < 64:
        raise ValueError(f"token_rows takes 64 tokens a step or more (wgmma's rows), not block_n {block_n}")
    tile = _default_tile(head_dim, num_splits, fp8, token_rows, fp8_mma)
    block_n, num_warps, num_stages = block_n or tile[0], num_warps or tile[1], num_stages or tile[2]
    if prefetch is None:
        prefetch = tile[3]
    float16_operands = fp8 and not cuda_cores and (f16_dot or q.dtype == torch.float16)
    if convert_v and not float16_operands:
        raise ValueError("convert_v converts an fp8 cache's V for float16 tensor-core operands only")
    if convert_v is None:  # where it was measured: the prefetching tile of a split or two a request
        convert_v = CONVERT_V and float16_operands and tile[3] and not token_rows
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
    # the group's heads: as they are on the CUDA cores, padded to 16 for tl.dot (rows, or with token_rows
    # columns: wgmma takes 8, but Triton 3.6 compiles a product that narrow to mma.sync)
    block_h = triton.next_power_of_2(group)
    block_h = block_h if cuda_cores else max(16, block_h)
    _split_kernel[(batch, num_kv_heads, num_splits)](
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
        BLOCK_H=block_h,
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
        FP8_MMA=fp8_mma,
        TOKEN_ROWS=token_rows,
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


def _default_tile(
    head_dim: int, num_splits: int, fp8: bool, token_rows: bool = False, fp8_mma: int = 0
) -> tuple[int, int, int, bool]:
    """(block_n, num_warps, num_stages, prefetch), the fastest in bench/fp8_decode.py (head_dim 128, page 16):
    128 tokens a step at a split or two a request (batch 256), 32 where many splits leave each a few blocks
    (batch 1). Over an fp8 cache at batch 256 the prefetching variant with three stages took 184.7 us against
    208.5 for the plain kernel's two (the bf16 cache's variants were within 1% of each other; at batch 1 every
    variant was). Past head_dim 128, 32 (a guess: K and V tiles twice the size). With tokens as the products'
    rows (token_rows), 64 tokens a step at least, as wgmma needs; over a half-precision cache 64 with three
    stages (compiled for sm_90 with Triton 3.6 at Qwen3-0.6B's heads: 70 KB, three programs an SM; 128 tokens
    with 8 warps took 137 KB, one). Over an fp8 cache with either product in float16 (fp8_mma 0 or 1), 128 tokens
    take all 255 registers a thread (mode 0 spills 104-736 bytes at Qwen3-8B's and 30B-A3B's heads), 64 with two
    stages 139-170: 64 there. Not yet timed on a GPU."""
    if token_rows and not fp8:
        return 64, 4, 3 if num_splits <= 2 else 2, False
    if token_rows and fp8_mma < 2:
        return 64, 4, 2, False
    if head_dim > 128 or num_splits > 2:
        return 64 if token_rows else 32, 4, 2, False
    return (128, 4, 3, True) if fp8 else (128, 4, 2, False)


def _fp8_tensor_cores(x: torch.Tensor) -> bool:
    """Whether x's GPU has the FP8 tensor-core products the kernel's fp8_mma compiles to (Hopper's wgmma,
    compute capability 9.0 or more); under the interpreter, which emulates them, always."""
    return INTERPRETED or (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0))


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
