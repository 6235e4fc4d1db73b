"""Triton kernels for steps' small work, where one launch replaces several:
- the attention prologue (from the QKV projection's output: RMSNorm on each query and key head for
  Qwen3, rotary embedding on both, and the step's keys and values written into the KV cache: about
  seven kernels a layer unfused), under Kernels.triton;
- sampling (greedy and Gumbel-max temperature sampling, the (seed, position, token) hash inside: two
  kernels over many blocks where the torch path launches about seventy), and the KV-cache store of
  keys and values in one launch instead of two: used on CUDA whenever Triton is installed.
On the CPU they run only under Triton's interpreter, for an engine whose Kernels ask for it
(`interpret_on_cpu`, with TRITON_INTERPRET=1: how the tests check them against the torch paths, which
stay the reference). Whether a kernel applies is a function of the tensors and the caller's Kernels."""

from __future__ import annotations

import functools
import logging
import os

import torch

from worker.kernels import Kernels

log = logging.getLogger(__name__)
_SAMPLE_BLOCK = 2048  # 75 blocks a row over a vocabulary of 151,936
_SAMPLE_WARPS = 4


@functools.cache
def _interpreter() -> bool:
    """Triton was imported to interpret (it reads the variable once, at its import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreting(kernels: Kernels) -> bool:
    """Whether these kernels ask for Triton on CPU tensors and Triton was imported to interpret them."""
    return kernels.interpret_on_cpu and _interpreter()


def interpreted(kernels: Kernels) -> bool:
    """Whether these kernels ask for Triton's kernels on CPU tensors, under the interpreter."""
    return kernels.interpret_on_cpu and kernels.triton and _interpreter()


def available(kernels: Kernels, x: torch.Tensor) -> bool:
    """The kernels under Kernels.triton (the attention prologue) for x."""
    return kernels.triton and _kernels() is not None and (x.is_cuda or interpreted(kernels))


def prologue_applies(
    kernels: Kernels, qkv: torch.Tensor, head_dim: int, cache_dtype: torch.dtype | None = None
) -> bool:
    return (
        not head_dim & (head_dim - 1)
        and qkv.is_contiguous()
        and available(kernels, qkv)
        and (cache_dtype is None or cache_dtype_supported(cache_dtype, qkv.device))
    )


def warn_if_absent(kernels: Kernels, device: torch.device) -> None:
    """At an engine's start: whether it runs the torch kernels where Triton's were asked for."""
    if kernels.triton and device.type == "cuda" and _kernels() is None:
        log.warning("Triton is not installed: using the torch kernels instead of Triton's")


def cache_dtype_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels can write a KV cache of dtype there. Float8 e4m3 (Triton's float8e4nv) needs
    CUDA compute capability 8.9 (Ada, Hopper); Triton's interpreter rounds to it wrongly (it drops the
    carry into the exponent: 31.2 becomes 16), so on the CPU the torch store writes an fp8 cache."""
    return dtype != torch.float8_e4m3fn or (device.type == "cuda" and _capability(device.index) >= (8, 9))


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, looked up once per device."""
    return _capability(device.index)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_applies(kernels: Kernels, device: torch.device) -> bool:
    """Whether the Triton kernels of a step on `device` launch with programmatic dependent launch
    (Kernels.pdl on, or auto resolved on by the engine, on a GPU of compute capability 9.0+;
    worker/pdl_kernels.py)."""
    return kernels.pdl == "on" and device.type == "cuda" and _capability(device.index) >= (9, 0)


def pdl_options(pdl: bool) -> dict:
    """A launch's options for a kernel whose PDL argument is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


# output columns a program of the GEMVs whose columns are independent (gemv.small_linear, the FP8 GEMV) under
# Triton's interpreter, which runs programs one after another: a few wide ones cost less than many narrow
# ones, and each column's sum is the same at any width
INTERPRETED_BLOCK_N = 64

# Which programs of a GEMV launched with PDL prefetch their weight rows before the wait: the first
# PDL_PREFETCH_PROGRAMS_PER_SM a multiprocessor where the whole weight holds at most PDL_PREFETCH_MAX_BYTES,
# none in larger ones. bench/pdl_prefetch.py on an H100 (2026-12-05), batch 1's GEMV chain, us a layer
# without PDL / with it while every program prefetches / the first 8 a multiprocessor / none:
# Qwen3-0.6B (weights of 4-13 MB) 19.44 / 16.60 / 16.45 / 16.90; Qwen3-8B (34-201 MB) 130.7 / 151.1 /
# 137.8 / 128.4, and with FP8 weights 72.85 / 79.6 / 77.5 / 71.3. A long kernel streams its weights at the
# memory's speed anyway, and what the next one prefetches beside it only competes (and, past a wave, is
# evicted before it is read)
PDL_PREFETCH_PROGRAMS_PER_SM = 8
PDL_PREFETCH_MAX_BYTES = 16_000_000
# every program prefetches (what `prefetch_programs` takes for "all")
PDL_PREFETCH_ALL = 2**31 - 1


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def prefetch_programs(weight: torch.Tensor, pdl: bool, override: int | None = None) -> int:
    """How many of a GEMV's programs over `weight` prefetch their rows before the wait: none without PDL,
    `override` if given."""
    if not pdl:
        return 0
    if override is not None:
        return override
    if weight.device.type != "cuda":  # the interpreter, or kernel_compile's stand-ins (no GPU to ask)
        return 0
    return default_prefetch_programs(weight.numel() * weight.element_size(), _multiprocessors(weight.device.index or 0))


def default_prefetch_programs(weight_bytes: int, multiprocessors: int) -> int:
    """The rule above: how many programs of a PDL GEMV over `weight_bytes` of weights prefetch."""
    return 0 if weight_bytes > PDL_PREFETCH_MAX_BYTES else PDL_PREFETCH_PROGRAMS_PER_SM * multiprocessors


def triton_installed() -> bool:
    return _kernels() is not None


@functools.cache
def _kernels():
    try:
        from worker import triton_kernels
    except ImportError:  # no Triton here
        return None
    return triton_kernels


class _Cdiv:
    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()


triton = _Cdiv  # the two helpers the launchers need, without importing Triton where it is absent


def qkv_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], contiguous. Writes the normed, rotated keys
    and the values at out_loc of k_cache / v_cache ([slots, num_kv_heads, head_dim]); returns the
    normed, rotated queries [T, num_heads, head_dim]. q_weight/k_weight None: no q/k norm.
    block_tokens / num_warps: the tokens of one program and its warps (None: prologue_tiles). `pdl`:
    launched with programmatic dependent launch (pdl_applies)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    has_norm = q_weight is not None
    auto_block, auto_warps = prologue_tiles(tokens)
    block_tokens, num_warps = block_tokens or auto_block, num_warps or auto_warps
    if block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, not {block_tokens}")
    _kernels().qkv_prologue_kernel[(triton.cdiv(tokens, block_tokens), num_heads + num_kv_heads)](
        qkv,
        positions,
        out_loc,
        cos_sin,
        q_weight if has_norm else cos_sin,
        k_weight if has_norm else cos_sin,
        q,
        k_cache,
        v_cache,
        eps,
        tokens,
        qkv.stride(0),
        cos_sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        BLOCK_T=block_tokens,
        PDL=pdl,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    return q


# (most tokens, (tokens a program, warps)) by step size. A decode step's few tokens: one a program, one
# warp, as many programs as (token, head) pairs; more tokens: blocks of them a program, so that each program
# moves kilobytes, not one head's 256 bytes. bench/prologue.py on the H200, Qwen3-0.6B's heads: 1 token
# 1.77 us with one warp against 2.16 with four; 256 tokens 3.64 us in blocks of 4 against 7.50 one token a
# program; 8,192 tokens 38.6 us in blocks of 8 against 155.8 (the bounds between those sizes are not
# measured)
PROLOGUE_TILES = ((32, (1, 1)), (1024, (4, 4)), (None, (8, 4)))
# the fewest tokens of each tile: what an engine's warm-up runs so that no step compiles a tile
PROLOGUE_TILE_STARTS = (1, *(most + 1 for most, _ in PROLOGUE_TILES[:-1]))


def prologue_tiles(tokens: int) -> tuple[int, int]:
    """(tokens a program, warps) of the attention prologue for a step of `tokens` tokens."""
    for most, tile in PROLOGUE_TILES:
        if most is None or tokens <= most:
            return tile
    raise AssertionError("the last tile takes any size")


def kernels_available(kernels: Kernels, x: torch.Tensor) -> bool:
    """The sampler and KV-store kernels: on CUDA whenever Triton is installed (they replace dozens of
    torch launches, or two, with two, or one); on the CPU only under the interpreter, when `kernels`
    ask for it (the tests)."""
    return _kernels() is not None and (x.is_cuda or interpreted(kernels))


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    token_pool: torch.Tensor | None = None,
    token_write: torch.Tensor | None = None,
    block: int = _SAMPLE_BLOCK,
    num_warps: int = _SAMPLE_WARPS,
    pdl: bool = False,
) -> torch.Tensor:
    """What `worker.sampling.sampler.sample_unfiltered` computes (the argmax where temperature <= 0, else the
    Gumbel-max draw of (seed, position)), for logits [B, V] of any float dtype with unit stride along
    V: one kernel over (row, block of the vocabulary), one over rows. Returns int32 [B] (in `out` when
    given); with `token_pool` (flat int32) also writes each row's token at token_pool[token_write[row]].
    The two may part from the torch path only where float rounding of the noise breaks a near-tie.
    `block` / `num_warps`: the vocabulary a program of the first kernel and its warps (any split picks the
    same token: the first index of the largest value). `pdl`: launched with programmatic dependent launch."""
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    assert logits.stride(1) == 1
    blocks = triton.cdiv(vocab, block)
    val = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, blocks, dtype=torch.int32, device=logits.device)
    k = _kernels()
    k.sample_partial_kernel[(rows, blocks)](
        logits,
        logits.stride(0),
        temperature,
        seeds,
        positions,
        val,
        idx,
        vocab,
        blocks,
        BLOCK=block,
        FAST_LOG=logits.is_cuda,
        PDL=pdl,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    has_pool = token_pool is not None
    k.sample_reduce_kernel[(rows,)](
        val,
        idx,
        blocks,
        vocab,
        out,
        token_pool if has_pool else out,
        token_write if has_pool else out,
        HAS_POOL=has_pool,
        NB=max(triton.next_power_of_2(blocks), 2),
        PDL=pdl,
        **pdl_options(pdl),
    )
    return out


def kv_store(loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """k_cache[loc] = k and v_cache[loc] = v in one launch, when each token's [kv_heads, head_dim] is
    contiguous in k and v (views of the QKV projection's output are); False when it does not apply.
    A float8 cache gets k and v saturated at +-448 and rounded to nearest, as worker/kv_cache.py stores them."""
    tokens = k.shape[0]
    row = k_cache[0].numel()
    if not (
        k[0].numel() == row
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and k.dim() == 3
        and k.stride(1) == k.shape[2]
        and v.stride(1) == v.shape[2]
        and cache_dtype_supported(k_cache.dtype, k_cache.device)
    ):
        return False
    if tokens:
        _kernels().kv_store_kernel[(tokens,)](
            k,
            v,
            k.stride(0),
            v.stride(0),
            loc,
            k_cache,
            v_cache,
            ROW=row,
            BLOCK=triton.next_power_of_2(row),
            FP8=k_cache.dtype == torch.float8_e4m3fn,
        )
    return True
