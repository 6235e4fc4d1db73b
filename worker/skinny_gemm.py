"""Matrix products at decode batches' row counts (a few to a few hundred rows) in Triton, for bf16 and
e4m3 operands: the weight read once, in tiles narrow enough over N (and split over K where K is long
beside a narrow N) that every multiprocessor reads weights, where cuBLASLt's FP8 GEMM read Qwen3-8B's
N = 4,096 layers well below the memory's speed (bench/fp8_gemm.py). A split product sums its partials in a fixed order
(the kernel's last program for each tile adds them in K's order), so its result does not depend on the
order the programs ran in. bench/fp8_gemm.py times it beside cuBLAS and cuBLASLt and sweeps its tiles."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from worker import triton_ops
from worker.kernels import Kernels

NO_SCALES, ROW_SCALES, BLOCK_SCALES = 0, 1, 2


@dataclass(frozen=True)
class MmTile:
    """A launch of skinny_mm_kernel: its output tile, K step, split of K, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Rows up to which a product takes the narrow tiles below; past it (prompt chunks) the large tiles of a
# compute-bound GEMM
SKINNY_MAX_ROWS = 128
# Up to these rows an FP8 product with per-channel scales and at most NARROW_N output columns (Qwen3-8B's o
# and down) takes 64-row tiles of 128 columns: at 256 rows bench/fp8_gemm.py --sweep found them ahead of
# cuBLASLt (an H100, 2026-12-05: o 13.17 against 14.62 us, down 30.56 against 33.91; qkv, N = 6,144, lost:
# 18.87 against 16.77), where 128-row tiles leave half of the GPU's multiprocessors without a program.
# Measured at 256 rows and N = 4,096 only: 129-255 rows (prompt chunks of that size too) and narrower layers
# (smaller models', tensor-parallel shards) follow by extrapolation
FULL_BATCH_ROWS = 256
NARROW_N = 4096
MEDIUM_N = 8192  # up to SKINNY_MAX_ROWS rows, FP8 layers up to this wide (qkv; not gate-up) pay
FULL_BATCH_TILE = MmTile(64, 128, 256, 1, 4, 4)  # e4m3: 256 of K a step is 256 bytes


def mm_tile(m: int, n: int, k: int, element_bytes: int, group_k: int | None = None) -> MmTile:
    """The tile for an [m, k] @ [k, n] product of `element_bytes` operands (block-scaled: K steps of the
    scales' group). Up to SKINNY_MAX_ROWS rows, as bench/fp8_gemm.py --sweep found on Qwen3-8B's layers
    (an H100, 2026-12-05): the rows in one tile, 256 bytes of K a step, 32 output columns a program up to
    N = 4,096 and 64 beyond, and K split in two only at 16 rows or fewer where K is twice N or more (down:
    23.0 against 24.7 us); every other split was slower, up to twice as slow at 64 and 128 rows. Past it, an
    FP8 product of per-channel scales and at most NARROW_N columns up to FULL_BATCH_ROWS takes FULL_BATCH_TILE."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if element_bytes == 1 and group_k is None and SKINNY_MAX_ROWS < m <= FULL_BATCH_ROWS and n <= NARROW_N:
        return FULL_BATCH_TILE
    if m > SKINNY_MAX_ROWS:
        return MmTile(block_m, 128, group_k or 128 // element_bytes, 1, 8 if block_m == 128 else 4, 3)
    block_n = 32 if n <= 4096 else 64
    block_k = group_k or 256 // element_bytes
    split = 2 if m <= 16 and k >= 2 * n else 1
    return MmTile(block_m, block_n, block_k, min(split, triton_ops.triton.cdiv(k, block_k)), 4, 4)


def _fit(tile: MmTile, element_bytes: int, device: torch.device) -> MmTile:
    """`tile` with fewer pipeline stages where its operands' stages would pass the GPU's shared memory (an
    Ada GPU holds 99 KB a program, a Hopper 227: 128 rows of 256 bytes beside 64 take 196 KB at 4 stages)."""
    if device.type != "cuda":
        return tile
    stage = (tile.block_m + tile.block_n) * tile.block_k * element_bytes
    stages = min(tile.num_stages, max(1, (_shared_bytes(device.index) - 2048) // stage))  # leaves Triton's own
    return tile if stages == tile.num_stages else MmTile(**{**tile.__dict__, "num_stages": stages})


@functools.cache
def _shared_bytes(index: int | None) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block


def pays(rows: int, weight: torch.Tensor) -> bool:
    """Where the sweep found the Triton GEMM ahead of the vendor's on Qwen3-8B's layers (an H100,
    2026-12-05). FP8 against cuBLASLt (fast accumulation; a layer's four at 16 / 64 / 128 rows, 85.8 / 90.7
    / 100.4 us at these tiles against 104.8 / 104.8 / 106.4): o and down (N = 4,096) and qkv at every row
    count up to 128, gate-up (N = 24,576) up to 64 rows (38.5 against 42.0 us at 16, 42.2 against 42.5 at
    64, 47.2 against 43.1 at 128), and o and down up to FULL_BATCH_ROWS. bf16 against cuBLAS: up to 16 rows
    (149.3 against 155.1; it lost from 64)."""
    if weight.element_size() > 1:
        return rows <= 16
    n = weight.shape[0]
    return rows <= 64 or (rows <= SKINNY_MAX_ROWS and n <= MEDIUM_N) or (rows <= FULL_BATCH_ROWS and n <= NARROW_N)


# The weight dtypes whose linear layers multiply through `matmul` by default (Kernels.decode_gemm auto), where
# `pays`: those measured faster end to end (bench/gpu.sh gemm_ab). e4m3: Qwen3-8B's (a) with FP8 weights
# 10,077 and 10,080 output tok/s against cuBLASLt's 9,988 and 9,982 (two alternated pairs, one H100,
# 2026-12-05). bf16 lost there (8,073 against 8,197 on the earlier tiles) and is not measured on these.
# Kernels(decode_gemm="triton") asks for it for every dtype
AUTO_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn})


def chosen(kernels: Kernels, rows: int, weight: torch.Tensor) -> bool:
    """Whether a linear layer of `rows` rows over `weight` multiplies here (where it can): where it `pays`,
    with Kernels.decode_gemm triton, or auto for the dtypes of AUTO_DTYPES."""
    if kernels.decode_gemm == "vendor" or (kernels.decode_gemm == "auto" and weight.dtype not in AUTO_DTYPES):
        return False
    return pays(rows, weight) and _kernels() is not None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `matmul` can compute x @ weight.T without scales (where `chosen`, which needs Triton):
    half-precision operands of one dtype on a GPU, rows and weight contiguous."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.is_contiguous()
    )


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    group_k: int | None = None,
    tile: MmTile | None = None,
) -> torch.Tensor:
    """a [M, K] @ b [N, K].T, summed in float32, in `out_dtype`. Scales (e4m3 operands): group_k None, a's
    per row (a_scale [M, 1]) and b's per row (b_scale [N]); group_k given, both per group_k columns
    (a_scale [M, K / group_k], b_scale [N, K / group_k])."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    tile = tile or _fit(mm_tile(m, n, k, a.element_size(), group_k), a.element_size(), a.device)
    if group_k is not None and tile.block_k != group_k:
        raise ValueError(f"a block-scaled product steps through K by its scales' group ({group_k}), not {tile.block_k}")
    scales = NO_SCALES if a_scale is None else ROW_SCALES if group_k is None else BLOCK_SCALES
    steps = triton_ops.triton.cdiv(k, tile.block_k)
    splits = triton_ops.triton.cdiv(steps, triton_ops.triton.cdiv(steps, tile.split_k))  # none left empty
    n_tiles, m_tiles = triton_ops.triton.cdiv(n, tile.block_n), triton_ops.triton.cdiv(m, tile.block_m)
    m_first = m > SKINNY_MAX_ROWS  # a prompt chunk's programs share their weight tile (the kernel's comment)
    counts = _split_counts(a.device) if splits > 1 and n_tiles * m_tiles <= MAX_SPLIT_TILES else None
    if counts is None:
        splits = 1
        counts = _placeholder(a.device)
        part = counts.view(torch.float32)  # not written: the partials' type, so the launch compiles as one
    else:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    grid = (m_tiles, splits, n_tiles) if m_first else (n_tiles, splits, m_tiles)
    a_scale = counts if a_scale is None else a_scale  # not read without scales
    b_scale = counts if b_scale is None else b_scale
    _kernels().skinny_mm_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        out,
        part,
        counts,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        b.stride(0),
        b_scale.stride(0),
        out.stride(0),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        SCALES=scales,
        SPLIT=splits > 1,
        M_FIRST=m_first,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


# One count per output tile of a split product, a buffer per stream: each launch's last program for a
# tile resets its count, so a buffer is zeroed once and every launch finds it so, as long as no two launches
# that share it run at once. An engine launches on its compute stream and captures its CUDA graphs there
# (worker/engine.py), and a stream runs its kernels one at a time; engines beside each other on one GPU (a
# draft model's) have streams, and buffers, of their own.
MAX_SPLIT_TILES = 1 << 14
_counts: dict[tuple[torch.device, int], torch.Tensor] = {}


def _split_counts(device: torch.device) -> torch.Tensor | None:
    """The current stream's counts on `device`; None (the product then not split) where it has none yet
    and a CUDA graph is being captured, which would record the buffer's zeroing instead of running it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _counts:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counts[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _counts[key]


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.cache
def _kernels():
    try:
        from worker import skinny_gemm_kernels
    except ImportError:  # no Triton here
        return None
    return skinny_gemm_kernels
