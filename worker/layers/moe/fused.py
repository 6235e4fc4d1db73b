"""The fused MoE path: top-k routing and the sort of tokens by expert on the device, then the two grouped
GEMMs of triton_kernels.py and a sum over each token's choices; for a few tokens (decode at small
batch) the per-row kernels instead, which route, multiply and combine in two launches. Every shape is
fixed by the token count (the block count has a static upper bound), nothing waits on the host: safe
inside the decode CUDA graphs."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from worker import triton_ops
from worker.kernels import Kernels
from worker.layers.moe.weights import ExpertScales
from worker.quant.gemm import quantize_activations

log = logging.getLogger(__name__)


@functools.cache
def _kernels():
    try:
        from worker.layers.moe import triton_kernels
    except ImportError:  # no Triton here
        return None
    return triton_kernels


def fused_applies(kernels: Kernels, x: torch.Tensor) -> bool:
    if kernels.moe == "torch" or _kernels() is None:
        return False
    return x.is_cuda or triton_ops.interpreting(kernels)


@dataclass(frozen=True)
class ExpertOrder:
    """(token, choice) rows sorted by expert, each expert's run padded to whole blocks of block_m.

    sorted_ids [max_blocks * block_m]: row ids (t * top_k + k), padding holds num_rows; expert_ids
    [max_blocks]: each block's expert, -1 past the last; num_padded [1]: the rows up to the last block."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def _scale_args(scales: torch.Tensor | None, w: torch.Tensor) -> tuple:
    # (pointer, stride over experts, stride over rows): a kernel without scales is given w and reads nothing
    if scales is None:
        return w, 0, 0
    if scales.dtype != torch.float32 or (scales.stride(2) != 1 and scales.shape[2] > 1):
        raise ValueError(
            f"expert scales must be float32 with their groups contiguous, not {scales.dtype} {scales.stride()}"
        )
    return scales, scales.stride(0), scales.stride(1)


def _groups(scales: ExpertScales | None, hidden: int, inter: int) -> tuple[int, int]:
    """The kernels' GROUP_K of gate-up (over hidden) and down (over inter): 0 without scales, and 0 where a
    group spans the whole width (its one scale a row)."""
    if scales is None:
        return 0, 0
    groups = tuple(g if g < width else 0 for g, width in ((scales.gate_up_group, hidden), (scales.down_group, inter)))
    if any(g and (g < 16 or g & (g - 1)) for g in groups):
        raise ValueError(f"expert scale groups must be powers of two of at least 16 columns, not {groups}")
    return groups


def _capped(block_k: int, group: int) -> int:
    # a tile of columns never crosses a scale group
    return min(block_k, group) if group else block_k


# rows (tokens x top_k) up to which one program sorts them (every decode batch and a prompt chunk of up to
# 2,048 tokens at 8 choices); more are sorted by torch ops (some twenty launches, nothing that waits on the
# host either). On an H200 at 8 of 128 experts: 14.5 us against torch's 82.4 at 2,048 rows, 257 against
# 147 at 65,536 (contended atomics); the crossover between is not measured
ALIGN_KERNEL_MAX_ROWS = 16384
# rows the sort takes at a time: at least a lane a thread of its 8 warps (256), so no lane is held twice
ALIGN_CHUNK = 1024


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, kernel: bool = True) -> ExpertOrder:
    rows = ids.numel()
    max_blocks = -(-(rows + num_experts * (block_m - 1)) // block_m)
    if not kernel or rows > ALIGN_KERNEL_MAX_ROWS:
        return _align_torch(ids, num_experts, block_m, max_blocks)
    e_p2 = triton_ops.triton.next_power_of_2(num_experts)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    scratch = torch.empty(2 * e_p2 + rows, dtype=torch.int32, device=ids.device)
    _kernels().moe_align_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        num_padded,
        scratch,
        rows,
        num_experts,
        sorted_ids.numel(),
        max_blocks,
        BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK,  # one size for any row count (a variant less; a few rows mask the rest of a pass)
        E_P2=e_p2,
        FILL=1024,
        **({"num_warps": 8} if ids.is_cuda else {}),
    )
    return ExpertOrder(sorted_ids, expert_ids, num_padded, block_m)


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int, max_blocks: int) -> ExpertOrder:
    flat = ids.flatten().long()  # the route kernel's ids are int32; scatter_add_ and the sort want int64
    rows = flat.numel()
    # scatter_add rather than bincount, which would ask the host for the largest id
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    experts, order = torch.sort(flat, stable=True)
    dest = (padded_end - padded)[experts] + torch.arange(rows, device=ids.device) - start[experts]
    sorted_ids = torch.full((max_blocks * block_m,), rows, dtype=torch.int64, device=ids.device)
    sorted_ids.scatter_(0, dest, order)
    blocks = torch.arange(max_blocks, device=ids.device)
    expert_ids = torch.searchsorted(padded_end // block_m, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return ExpertOrder(sorted_ids, expert_ids, padded_end[-1:], block_m)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.select_experts in one launch: (weights [T, top_k] in logits' dtype, ids [T, top_k] int32)."""
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _kernels().moe_route_kernel[(tokens,)](
            logits,
            weights,
            ids,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            K_P2=triton_ops.triton.next_power_of_2(top_k),
            E_P2=triton_ops.triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            COPIES=1,
            # one warp holds a token's logits: its reductions need no barrier
            **({"num_warps": 1} if logits.is_cuda else {}),
        )
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    pdl: bool = False,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Routing and the experts: this rank's part of the block's output. `pdl`: the per-row kernels
    launched with programmatic dependent launch (worker/pdl_kernels.py). `scales`: w13 and w2 are e4m3."""
    if per_row_applies(x.shape[0] * top_k, w13.shape[0]):
        return _per_row(x, w13, w2, top_k, logits=logits, renormalize=renormalize, pdl=pdl, scales=scales)
    weights, ids = route(logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, scales=scales)


def per_row_applies(rows: int, num_experts: int) -> bool:
    """Whether the per-row kernels compute these rows: each reads its expert's weights for itself, so
    rows that share an expert read it twice; with at most a quarter as many rows as experts few do (a
    batch of 4 at Qwen3-MoE's 8 of 128, one token at Mixtral's 2 of 8), and the sort and the grouped
    GEMMs' padded blocks cost more than the repeats."""
    return 4 * rows <= num_experts


# (BLOCK_N, BLOCK_K, num_warps) of the per-row kernels on CUDA, the fastest at one token over
# Qwen3-30B-A3B's experts in bench/moe_decode.py: gate_up over hidden, down over inter (1024 covers its 768
# in one step: 32.8 us a layer for both kernels, against 42.4 with 256)
PER_ROW_GATE_UP = (8, 512, 4)
PER_ROW_DOWN = (8, 1024, 4)
# (BLOCK_N, num_warps) of the down kernel's variant that loads every choice's weights at once (where the
# expert width fits one block); None: the loop over choices. On an H100 (2026-12-05) two columns a program
# and four warps were the fastest of the sweep (bench/moe_decode.py --sweep: 34.5 us a layer for the pair
# against the loop's 35.9), and Qwen3-30B-A3B's batch-1 decode took 3.463 and 3.478 ms a token against the
# loop's 3.556 and 3.593
PER_ROW_DOWN_AT_ONCE: tuple[int, int] | None = (2, 4)
# the same over FP8 experts, from bench/moe_decode.py --fp8 0 and --fp8 128 --sweep on an H100 (2026-12-06):
# four columns a program, 23.0 and 23.9 us a layer for the pair (a scale a row, one every 128 columns)
# against 24.0 and 24.5 at two
PER_ROW_DOWN_AT_ONCE_FP8 = (4, 4)


def _per_row(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    renormalize: bool = False,
    pdl: bool = False,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The per-row path, from the router's logits (routing inside the first kernel) or from a routing."""
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    rows = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    route_here = logits is not None
    if route_here:
        weights = torch.empty(rows, dtype=logits.dtype, device=x.device)
        ids = torch.empty(rows, dtype=torch.int32, device=x.device)
    else:  # logits stands in for an argument the kernel does not read without ROUTE
        weights, ids, logits = weights.flatten().contiguous(), ids.flatten().contiguous(), x
    kernels = _kernels()
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    group13, group2 = _groups(scales, hidden, inter)
    # a tile wider than a group sums each group apart (the kernel's reshape); one narrower stays in a group
    block_n, block_k, options = _row_tiles(PER_ROW_GATE_UP, x.is_cuda, inter, hidden)
    kernels.moe_row_gate_up_kernel[(rows, triton_ops.triton.cdiv(inter, block_n))](
        x,
        w13,
        h,
        logits,
        weights,
        ids,
        num_experts,
        hidden,
        inter,
        x.stride(0),
        logits.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        *_scale_args(scales and scales.gate_up, w13),
        TOP_K=top_k,
        K_P2=triton_ops.triton.next_power_of_2(top_k),
        E_P2=triton_ops.triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
        ROUTE=route_here,
        COPIES=options.get("num_warps", 1),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        SCALED=scales is not None,
        GROUP_K=group13,
        **options,
        **triton_ops.pdl_options(pdl),
    )
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    at_once = PER_ROW_DOWN_AT_ONCE is not None and inter <= _AT_ONCE_MAX_K
    if at_once:
        block_n, warps = PER_ROW_DOWN_AT_ONCE_FP8 if scales is not None else PER_ROW_DOWN_AT_ONCE
        block_n, block_k = _fit(block_n, hidden, 1), triton_ops.triton.next_power_of_2(inter)
        options = {"num_warps": warps} if x.is_cuda else {}
    else:
        block_n, block_k, options = _row_tiles(PER_ROW_DOWN, x.is_cuda, hidden, inter)
        block_k = _capped(block_k, group2)
    kernels.moe_row_down_kernel[(tokens, triton_ops.triton.cdiv(hidden, block_n))](
        h,
        w2,
        out,
        weights,
        ids,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        *_scale_args(scales and scales.down, w2),
        TOP_K=top_k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_P2=triton_ops.triton.next_power_of_2(top_k),
        AT_ONCE=at_once,
        PDL=pdl,
        SCALED=scales is not None,
        GROUP_K=group2,
        **options,
        **triton_ops.pdl_options(pdl),
    )
    return out


_AT_ONCE_MAX_K = 1024  # the widest expert the down kernel's at-once variant holds in one block


def _row_tiles(tiles: tuple[int, int, int], cuda: bool, width_n: int, width_k: int) -> tuple[int, int, dict]:
    """A per-row kernel's (BLOCK_N, BLOCK_K, launch options), fitted to its widths; under the interpreter
    small tiles (its cost grows with the tile) and no launch options."""
    block_n, block_k, warps = tiles if cuda else (16, 64, None)
    return _fit(block_n, width_n, 1), _fit(block_k, width_k), {"num_warps": warps} if cuda else {}


# (most rows an expert, block height) of the grouped GEMMs: a block about as tall as an expert's usual share
# of the rows: at 8 or fewer (decode up to 128 tokens at Qwen3-MoE's 8 of 128) blocks of 16; at 16 a row
# (decode at 256) blocks of 32 were 7% faster (bench/moe_decode.py --grouped-sweep); a prompt chunk's
# hundreds, blocks of 128
BLOCK_HEIGHTS = ((8, 16), (48, 32), (128, 64), (None, 128))


def _block_m(rows: int, num_experts: int) -> int:
    per_expert = rows / num_experts
    return next(height for most, height in BLOCK_HEIGHTS if most is None or per_expert <= most)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMMs on CUDA by BLOCK_M, the fastest of
# bench/moe_decode.py --grouped-sweep on an H200 over Qwen3-30B-A3B's experts (the sort, both GEMMs and the
# sum, a layer): at 64 tokens 286.6 us (4.1 TB/s), at 256 323.7 us (3.7 TB/s; 362.5 with the earlier
# 16 x 32 x 64 tiles), at 8,192 1,707 us (362 TFLOP/s; 2,249 with 64 x 64 x 32). Blocks of 64 (between
# 768 and 2,048 tokens) take the best tile of 64 rows at 8,192, unmeasured where they apply
GROUPED_TILES = {16: (64, 128, 4, 3), 32: (64, 128, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}

# The grouped GEMMs over FP8 experts with a scale a row (quantization at load's) quantize their activations
# to e4m3 per token and multiply on the FP8 tensor cores, at blocks of at least this many rows: every block
# height, as the dense FP8 layers quantize theirs past one row. Widening the weights to bf16 in the K loop
# (w8a16, exact activations) made a compute-bound prompt chunk slower than bf16 and a decode batch slower
# than its bytes. On an H100 (Qwen3-30B-A3B's experts, 2026-12-06, us a layer, w8a8 / w8a16 / bf16): 1,244 /
# 2,392 / 1,656 at 8,192 tokens, 500 / 840 / 739 at 2,048, 339 / 510 / 537 at 1,024; 284 / 406 at 512, 249 /
# 286 / 429 at 256, 226 / 232 / 401 at 64. The per-row kernels (up to a quarter as many rows as experts) keep
# bf16 activations. Scales of a group of columns each (block-scaled checkpoints) stay w8a16: each K step's
# product must be weighed apart, outside the tensor cores' accumulation chain, and the best w8a8 tile took
# 2,503 us at 8,192 tokens against w8a16's 2,587 (1,024 tokens: 569 against 488)
W8A8_MIN_BLOCK_M = 16
# the tiles of the w8a8 GEMMs by BLOCK_M, as GROUPED_TILES (bench/moe_decode.py --grouped-sweep --fp8 0 at
# 8,192 tokens on an H100: 1,155 us at blocks of 128 rows, 1,365 at 64)
GROUPED_TILES_W8A8 = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3)}


def warm_token_counts(num_experts: int, top_k: int) -> list[int]:
    """Token counts that between them take every variant of the fused path's kernels (the per-row path,
    each block height of the grouped GEMMs, the sort's kernel and torch's), one count each: an engine
    runs them at start, so that no live step compiles one. Each variant holds the token counts between two
    of the paths' bounds on rows, so each one's first count is 1 or one past a bound."""
    bounds = (
        num_experts // 4,  # per_row_applies
        *(most * num_experts for most, _ in BLOCK_HEIGHTS[:-1]),
        ALIGN_KERNEL_MAX_ROWS,
    )
    counts, seen = [], set()
    for tokens in sorted({1, *(bound // top_k + 1 for bound in bounds)}):
        variant = _variant(tokens * top_k, num_experts)
        if variant not in seen:
            seen.add(variant)
            counts.append(tokens)
    return counts


def _variant(rows: int, num_experts: int) -> tuple:
    """What a launch of the fused path compiles for at this many rows, beside the model's shapes: the
    per-row kernels, or the grouped GEMMs' block height (its tiles follow) and which sort."""
    if per_row_applies(rows, num_experts):
        return ("per_row",)
    return ("grouped", _block_m(rows, num_experts), rows <= ALIGN_KERNEL_MAX_ROWS)


def _fit(tile: int, width: int, least: int = 16) -> int:
    return max(least, min(tile, triton_ops.triton.next_power_of_2(width)))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    per_row: bool | None = None,
    scales: ExpertScales | None = None,
    w8a8: bool | None = None,
) -> torch.Tensor:
    """What torch_experts computes: in three launches and a sum, or in the per-row path's two (`per_row`;
    by default where per_row_applies). x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights and ids [T, top_k];
    `scales`: w13 and w2 are e4m3 (ExpertScales); `w8a8`: the grouped GEMMs quantize their activations to
    e4m3 too (by default where w8a8_applies)."""
    tokens = x.shape[0]
    num_experts = w13.shape[0]
    top_k = ids.shape[1]
    rows = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    if per_row is None:
        per_row = per_row_applies(rows, num_experts)
    if per_row:
        return _per_row(x, w13, w2, top_k, weights=weights, ids=ids, scales=scales)
    order = align_by_expert(ids, num_experts, _block_m(rows, num_experts))
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = weights.flatten().contiguous()
    if w8a8 is None:
        w8a8 = w8a8_applies(scales, order.block_m, x, w2.shape[2])
    tiles = (GROUPED_TILES_W8A8 if w8a8 and order.block_m in GROUPED_TILES_W8A8 else GROUPED_TILES)[order.block_m]
    key = (order.block_m, x.dtype, x.device, scales and (scales.gate_up_group, scales.down_group), w8a8)
    if key not in _FELL_BACK:
        try:
            return _grouped_gemms(x, w13, w2, weights, order, top_k, tiles, scales, w8a8)
        except Exception as e:
            if type(e).__name__ != "OutOfResources":  # Triton's: the tiles need more than this GPU has
                raise
            log.warning("MoE tiles %s need more than this GPU has (%s): the smaller ones from now on", key, e)
            _FELL_BACK.add(key)
    return _grouped_gemms(x, w13, w2, weights, order, top_k, FALLBACK_TILES[order.block_m], scales, w8a8)


def w8a8_applies(scales: ExpertScales | None, block_m: int, x: torch.Tensor, inter: int) -> bool:
    """Whether the grouped GEMMs over these experts quantize their activations (fused_experts' `w8a8`): FP8
    experts with a scale a row, at blocks of W8A8_MIN_BLOCK_M rows or more, in a bf16 or fp16 model, on a
    GPU with FP8 tensor cores."""
    if scales is None or block_m < W8A8_MIN_BLOCK_M or not x.is_cuda:
        return False
    # a float32 model keeps exact activations, as its dense FP8 layers do; an FP8 product steps through K
    # 32 columns at a time
    if x.dtype not in (torch.bfloat16, torch.float16) or min(x.shape[1], inter) < 32:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return _groups(scales, x.shape[1], inter) == (0, 0)


# the tiles a block height falls back to where its own need more shared memory or registers than the GPU
# has (they were measured on an H200, for bfloat16; float32 operands take twice the shared memory): small,
# as the tiles before the sweep were. Fallen back: (block height, dtype, device, FP8 experts' groups or None)
FALLBACK_TILES = {16: (32, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 32, 4, 3), 128: (32, 32, 4, 2)}
_FELL_BACK: set[tuple] = set()


def _grouped_gemms(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    order: ExpertOrder,
    top_k: int,
    tiles: tuple[int, int, int, int],
    scales: ExpertScales | None = None,
    w8a8: bool = False,
) -> torch.Tensor:
    """The grouped path's two GEMMs over the rows in expert order, and the sum over each token's choices;
    `w8a8`: x and h quantized to e4m3 before the GEMM that reads them (fused_experts)."""
    kernels = _kernels()
    rows, hidden, inter = x.shape[0] * top_k, x.shape[1], w2.shape[2]
    ieee = x.dtype == torch.float32
    blocks = order.expert_ids.numel()
    tile_n, tile_k, warps, stages = tiles
    options = {"num_warps": warps, "num_stages": stages} if x.is_cuda else {}
    group13, group2 = _groups(scales, hidden, inter)
    x_in, x_scales = quantize_activations(x, group13 or hidden) if w8a8 else (x, x)

    h = x.new_empty(rows, inter)
    block_n, block_k = _fit(tile_n, inter), _capped(_fit(tile_k, hidden), group13)
    if w8a8 and block_k < 32:
        raise ValueError(f"an FP8 product steps through K 32 columns at a time, not {block_k} (w8a8)")
    kernels.moe_gate_up_kernel[(blocks * triton_ops.triton.cdiv(inter, block_n),)](
        x_in,
        w13,
        h,
        order.sorted_ids,
        order.expert_ids,
        order.num_padded,
        rows,
        hidden,
        inter,
        x_in.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        *_scale_args(scales and scales.gate_up, w13),
        x_scales,
        x_scales.stride(0),
        TOP_K=top_k,
        BLOCK_M=order.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=ieee,
        SCALED=scales is not None,
        GROUP_K=group13,
        W8A8=w8a8,
        **options,
    )
    h_in, h_scales = quantize_activations(h, group2 or inter) if w8a8 else (h, h)
    out = x.new_empty(rows, hidden)
    block_n, block_k = _fit(tile_n, hidden), _capped(_fit(tile_k, inter), group2)
    if w8a8 and block_k < 32:
        raise ValueError(f"an FP8 product steps through K 32 columns at a time, not {block_k} (w8a8)")
    kernels.moe_down_kernel[(blocks * triton_ops.triton.cdiv(hidden, block_n),)](
        h_in,
        w2,
        out,
        weights,
        order.sorted_ids,
        order.expert_ids,
        order.num_padded,
        rows,
        hidden,
        inter,
        h_in.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        *_scale_args(scales and scales.down, w2),
        h_scales,
        h_scales.stride(0),
        BLOCK_M=order.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=ieee,
        SCALED=scales is not None,
        GROUP_K=group2,
        W8A8=w8a8,
        **options,
    )
    return out.view(-1, top_k, hidden).sum(dim=1)
