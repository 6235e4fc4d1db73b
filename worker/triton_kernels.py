"""Triton kernels of worker/triton_ops.py (a module of their own: Triton's interpreter patches `tl` in
the kernels' module globals, and importing this needs Triton)."""

import triton
import triton.language as tl


@triton.jit
def qkv_prologue_kernel(qkv_ptr, pos_ptr, loc_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr,
                        k_cache_ptr, v_cache_ptr, eps, qkv_row_stride, cos_sin_row_stride,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HAS_NORM: tl.constexpr):
    # one program per (token, head) of the queries and keys; a key head's program also copies
    # the value head of the same index
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)
    row = qkv_ptr + t.to(tl.int64) * qkv_row_stride
    src = row + h * HEAD_DIM  # the key heads follow the query heads in the projection's output
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + half + offs).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        is_q = h < NUM_HEADS
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs), tl.load(k_weight_ptr + offs)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + half + offs), tl.load(k_weight_ptr + half + offs)).to(tl.float32)
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_row_stride + offs)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_row_stride + half + offs)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if h < NUM_HEADS:
        dst = q_out_ptr + (t.to(tl.int64) * NUM_HEADS + h) * HEAD_DIM
        tl.store(dst + offs, o1.to(q_out_ptr.dtype.element_ty))
        tl.store(dst + half + offs, o2.to(q_out_ptr.dtype.element_ty))
    else:
        j = h - NUM_HEADS
        cell = (tl.load(loc_ptr + t).to(tl.int64) * NUM_KV_HEADS + j) * HEAD_DIM
        tl.store(k_cache_ptr + cell + offs, o1.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + cell + half + offs, o2.to(k_cache_ptr.dtype.element_ty))
        v_src = row + (NUM_HEADS + NUM_KV_HEADS + j) * HEAD_DIM
        tl.store(v_cache_ptr + cell + offs, tl.load(v_src + offs))
        tl.store(v_cache_ptr + cell + half + offs, tl.load(v_src + half + offs))


@triton.jit
def sample_rows_kernel(logits_ptr, row_stride, temperature_ptr, u_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    # one program per row: the row's argmax and its softmax(logits / T) normalizer in one pass (an
    # online max and sum), then the inverse CDF at u * normalizer in a second; T <= 0 is greedy
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    t = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.maximum(t, 1e-5)
    offs = tl.arange(0, BLOCK)
    best = -float("inf")
    best_idx = 0
    total = 0.0
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=-float("inf"))
        block_max = tl.max(x, axis=0)
        block_idx = start + tl.argmax(x, axis=0)
        new_best = tl.maximum(best, block_max)
        # the first index of the row's largest value, as torch.argmax picks it
        best_idx = tl.where(block_max > best, block_idx, best_idx)
        total = total * tl.exp((best - new_best) * inv_t) + tl.sum(tl.exp((x - new_best) * inv_t), axis=0)
        best = new_best
    target = (tl.load(u_ptr + row) * total).to(tl.float32)
    found = -1
    last = best_idx  # the last token with probability: where rounding leaves the target past the end
    below = 0.0
    for start in range(0, vocab, BLOCK):
        valid = start + offs < vocab
        x = tl.load(base + start + offs, mask=valid, other=-float("inf"))
        p = tl.where(valid, tl.exp((x - best) * inv_t), 0.0)
        cdf = below + tl.cumsum(p, axis=0)
        first = tl.min(tl.where((cdf > target) & valid, offs, BLOCK), axis=0)
        found = tl.where((first < BLOCK) & (found < 0), start + first, found)
        last = tl.maximum(last, tl.max(tl.where(p > 0, start + offs, -1), axis=0))
        below = tl.max(tl.where(valid, cdf, 0.0), axis=0)
    found = tl.where(found < 0, last, found)
    tl.store(out_ptr + row, tl.where(t <= 0, best_idx, found).to(tl.int64))
