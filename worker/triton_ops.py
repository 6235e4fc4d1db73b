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


def _interpreted(kernels: Kernels) -> bool:
    return kernels.interpret_on_cpu and kernels.triton and _interpreter()


def available(kernels: Kernels, x: torch.Tensor) -> bool:
    """The kernels under Kernels.triton (the attention prologue) for x."""
    return kernels.triton and _kernels() is not None and (x.is_cuda or _interpreted(kernels))


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


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_applies(kernels: Kernels, device: torch.device) -> bool:
    """Whether the Triton kernels of a step on `device` launch with programmatic dependent launch
    (Kernels.pdl, on a GPU of compute capability 9.0+; worker/pdl_kernels.py)."""
    return kernels.pdl and device.type == "cuda" and _capability(device.index) >= (9, 0)


def pdl_options(pdl: bool) -> dict:
    """A launch's options for a kernel whose PDL argument is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


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
    return _kernels() is not None and (x.is_cuda or _interpreted(kernels))


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


def small_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` can compute x @ weight.T (the caller's Kernels.small_linear asks for it)."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and _kernels() is not None
    )


def small_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T for small M (a GEMV-like kernel that reads each weight once). `pdl`:
    launched with programmatic dependent launch, its weight rows prefetched before the wait."""
    m, k = x.shape
    n = weight.shape[0]
    # the fastest at M=1 over Qwen3-0.6B's layers in bench/small_gemm.py: one output column a program up
    # to N = 2048, two beyond, 1024 of K a step, four warps
    block_n = block_n or (1 if n <= 2048 else 2)
    block_k, num_warps = block_k or 1024, num_warps or 4
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _kernels().small_linear_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        M_BLOCK=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    return out


def row_fusion_applies(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row's residual norm (or SiLU-and-multiply) and the GEMV after it can run as one launch
    (`norm_linear`, `silu_linear`): batch-1 decode, with both the fused norms and the small-M GEMV asked
    for, in half precision on CUDA (and in any float dtype under the interpreter)."""
    if not (kernels.fused and kernels.small_linear and x.dim() == 2 and x.shape[0] == 1):
        return False
    if x.is_cuda:
        dtype_ok = x.dtype in (torch.bfloat16, torch.float16)
    else:
        dtype_ok = _interpreted(kernels) and x.dtype.is_floating_point
    return (
        dtype_ok
        and weight.dtype == x.dtype
        and weight.device == x.device
        and x.is_contiguous()
        and weight.is_contiguous()
        and _kernels() is not None
    )


def _norm_block_n(n: int) -> int:
    """Output columns a program of norm_linear: the fastest of 1-16 on an H200 (bench/row_fusion.py) at
    N = 128 and 4,096 (2) and 5,120 and 6,144 (4); 8 was at 24,576."""
    return 2 if n <= 4096 else 4 if n <= 16384 else 8


def _silu_block_n(n: int) -> int:
    """Output columns a program of silu_linear: the fastest at N = 1,024 (1) and 4,096 (2)."""
    return 1 if n <= 1024 else 2


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    write_normed: bool = False,
    block_n: int | None = None,
    block_k: int = 1024,
    num_warps: int = 4,
    one_block: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For one row x [1, K]: (rmsnorm(x + residual) @ weight.T, the new residual x + residual (x itself
    without one), the normed row with write_normed) in one launch. x and residual are left as they are.
    `one_block`: the whole row in one block (K up to NORM_MAX_K), every load issued before the norm's sum
    (bench/row_fusion.py times it beside the default, two passes over blocks of `block_k`). `pdl`: launched
    with programmatic dependent launch, the GEMV's weight rows prefetched before the wait."""
    k = x.shape[1]
    if one_block:
        block_k = triton.next_power_of_2(k)
    n = weight.shape[0]
    block_n = block_n or _norm_block_n(n)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if write_normed else None
    _kernels().norm_linear_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight,
        weight,
        out,
        res_out,
        normed if normed is not None else x,
        n,
        k,
        weight.stride(0),
        eps,
        HAS_RES=residual is not None,
        WRITE_NORMED=write_normed,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        ONE_BLOCK=one_block,
        PDL=pdl,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    return out, res_out, normed


def silu_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int = 1024,
    num_warps: int = 4,
    pdl: bool = False,
) -> torch.Tensor:
    """For one row gate_up [1, 2K] = [gate | up]: (silu(gate) * up) @ weight.T in one launch (`pdl`: as
    small_linear's)."""
    k = gate_up.shape[1] // 2
    n = weight.shape[0]
    block_n = block_n or _silu_block_n(n)
    out = torch.empty(1, n, dtype=gate_up.dtype, device=gate_up.device)
    _kernels().silu_linear_kernel[(triton.cdiv(n, block_n),)](
        gate_up,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        PDL=pdl,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    return out
