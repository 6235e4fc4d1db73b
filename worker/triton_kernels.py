"""Triton kernels of worker/triton_ops.py (a module of their own: Triton's interpreter patches `tl` in
the kernels' module globals, and importing this needs Triton)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from worker.pdl_kernels import await_previous

FP8_MAX = tl.constexpr(448.0)  # float8 e4m3's largest finite value (worker/kv_cache.py saturates there too)


@triton.jit
def _to_cache(x, cache_ptr, FP8: tl.constexpr):
    # an fp8 cache saturates as the torch store does (Triton's conversion need not), NaN kept
    if FP8:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["tokens"])  # one variant a tile, whatever the step's token count
def qkv_prologue_kernel(
    qkv_ptr,
    pos_ptr,
    loc_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    eps,
    tokens,
    qkv_row_stride,
    cos_sin_row_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program per (block of BLOCK_T tokens, head) of the queries and keys; a key head's program also
    # copies the value head of the same index. A prompt chunk takes blocks of tokens: one token a program
    # made programs of half a warp's work, and the kernel ran at a fifth of the memory's speed
    await_previous(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)[None, :]
    live = (t < tokens)[:, None]
    t64 = t.to(tl.int64)
    row = qkv_ptr + t64[:, None] * qkv_row_stride
    src = row + h * HEAD_DIM + offs  # the key heads follow the query heads in the projection's output
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        is_q = h < NUM_HEADS
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs), tl.load(k_weight_ptr + offs)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + half + offs), tl.load(k_weight_ptr + half + offs)).to(tl.float32)
        x1 = x1 * rstd[:, None] * w1
        x2 = x2 * rstd[:, None] * w2
    pos = tl.load(pos_ptr + t, mask=t < tokens, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[:, None] * cos_sin_row_stride + offs
    cos = tl.load(cs, mask=live, other=0.0)
    sin = tl.load(cs + half, mask=live, other=0.0)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if h < NUM_HEADS:
        dst = q_out_ptr + (t64[:, None] * NUM_HEADS + h) * HEAD_DIM + offs
        tl.store(dst, o1.to(q_out_ptr.dtype.element_ty), mask=live)
        tl.store(dst + half, o2.to(q_out_ptr.dtype.element_ty), mask=live)
    else:
        j = h - NUM_HEADS
        loc = tl.load(loc_ptr + t, mask=t < tokens, other=0).to(tl.int64)
        cell = (loc[:, None] * NUM_KV_HEADS + j) * HEAD_DIM + offs
        tl.store(k_cache_ptr + cell, _to_cache(o1, k_cache_ptr, FP8), mask=live)
        tl.store(k_cache_ptr + cell + half, _to_cache(o2, k_cache_ptr, FP8), mask=live)
        v_src = row + (NUM_HEADS + NUM_KV_HEADS + j) * HEAD_DIM + offs
        v1 = tl.load(v_src, mask=live, other=0.0)
        v2 = tl.load(v_src + half, mask=live, other=0.0)
        tl.store(v_cache_ptr + cell, _to_cache(v1, v_cache_ptr, FP8), mask=live)
        tl.store(v_cache_ptr + cell + half, _to_cache(v2, v_cache_ptr, FP8), mask=live)


@triton.jit
def _mix32(h):
    # the finalizer of worker/sampling/sampler.py, on uint32 (products wrap modulo 2**32 as its masks do)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x6C8E9CF5
    return h ^ (h >> 16)


@triton.jit
def _ln_near_one(f):
    # ln(1 + f) for f in [sqrt(1/2) - 1, sqrt(2) - 1]: Cephes' logf polynomial (about 1 ulp), relative
    # precision kept as f goes to 0
    z = f * f
    y = 7.0376836292e-2 * f - 1.1514610310e-1
    y = y * f + 1.1676998740e-1
    y = y * f - 1.2420140846e-1
    y = y * f + 1.4249322787e-1
    y = y * f - 1.6668057665e-1
    y = y * f + 2.0000714765e-1
    y = y * f - 2.4999993993e-1
    y = y * f + 3.3333331174e-1
    return f + (y * f * z - 0.5 * z)


@triton.jit
def _gumbel(u, FAST_LOG: tl.constexpr):
    # -ln(-ln u) for the sampler's uniforms u in (0, 1). The sampler is bound by instruction issue, and
    # libdevice's precise logf took about half of its 107 instructions a logit (sm_90 code); FAST_LOG
    # (CUDA) takes the hardware's approximate log2 (one instruction, about 22 bits) where its error is
    # small beside the result: the outer logarithm (its absolute error is the noise's) and u below
    # sqrt(1/2). Above that -ln u is tiny where the noise is largest, and its relative error is the
    # noise's absolute one, so there a polynomial in u - 1 (exact) keeps it. The interpreter has no
    # hardware log: there, and off CUDA, the precise one, as the torch sampler computes it
    if FAST_LOG:
        ln2: tl.constexpr = 0.6931471805599453
        e = tl.where(u >= 0.70710677, -_ln_near_one(u - 1.0), -ln2 * libdevice.fast_log2f(u))
        return -ln2 * libdevice.fast_log2f(e)
    else:
        return -tl.log(-tl.log(u))


@triton.jit
def sample_partial_kernel(
    logits_ptr,
    row_stride,
    temperature_ptr,
    seeds_ptr,
    pos_ptr,
    val_ptr,
    idx_ptr,
    vocab,
    num_blocks,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program per (row, block of the vocabulary): the block's largest logit / T + Gumbel noise (the
    # logit itself for a greedy row) and its first index; sample_reduce_kernel picks among the blocks
    await_previous(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + offs, mask=valid, other=-float("inf")).to(tl.float32)
    t = tl.load(temperature_ptr + row)
    if t > 0:
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        h = _mix32(lo) ^ _mix32(hi ^ 0x5BD1E995)
        key = _mix32(h ^ _mix32((pos & 0xFFFFFFFF).to(tl.uint32)))
        e = _mix32(_mix32(key ^ offs.to(tl.uint32)) ^ key)
        # held below 1 as the torch sampler's gumbel_noise holds it (2**24 - 0.5 rounds to 2**24)
        u = tl.minimum(((e >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.9999999403953552)
        inv_t = 1.0 / tl.maximum(t, 1e-5)
        x = x * inv_t + _gumbel(u, FAST_LOG)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_blocks + blk, best)
    tl.store(idx_ptr + row * num_blocks + blk, blk * BLOCK + where)


@triton.jit
def sample_reduce_kernel(
    val_ptr,
    idx_ptr,
    num_blocks,
    vocab,
    out_ptr,
    pool_ptr,
    write_ptr,
    HAS_POOL: tl.constexpr,
    NB: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program per row: the largest of the blocks' values, the first index among equals (as
    # torch.argmax picks it); written to out and, with a pool, into the token pool at write[row]
    await_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, NB)
    m = offs < num_blocks
    v = tl.load(val_ptr + row * num_blocks + offs, mask=m, other=-float("inf"))
    i = tl.load(idx_ptr + row * num_blocks + offs, mask=m, other=2**30)
    best = tl.max(v, axis=0)
    tok = tl.min(tl.where(v == best, i, 2**30), axis=0)
    tok = tl.minimum(tok, vocab - 1)  # no row is all -inf or NaN, but a write must stay in the pool
    tl.store(out_ptr + row, tok)
    if HAS_POOL:
        tl.store(pool_ptr + tl.load(write_ptr + row), tok)


@triton.jit
def kv_store_kernel(
    k_ptr,
    v_ptr,
    k_row_stride,
    v_row_stride,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    # one program per token: its keys and values (ROW = kv_heads * head_dim, contiguous within the
    # row) stored at its location of both caches in one launch
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    cell = tl.load(loc_ptr + t).to(tl.int64) * ROW
    k = tl.load(k_ptr + t.to(tl.int64) * k_row_stride + offs, mask=m)
    v = tl.load(v_ptr + t.to(tl.int64) * v_row_stride + offs, mask=m)
    tl.store(k_cache_ptr + cell + offs, _to_cache(k, k_cache_ptr, FP8), mask=m)
    tl.store(v_cache_ptr + cell + offs, _to_cache(v, v_cache_ptr, FP8), mask=m)
