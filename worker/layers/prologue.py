"""The attention prologue in one Triton kernel: from the QKV projection's output, RMSNorm on each query
and key head (Qwen3), rotary embedding on both, and the step's keys and values written into the KV
cache. Unfused this is about seven kernels a layer (two copies of strided views, two norms, rotary,
two cache writes); at small batch a decode step's time is mostly such launches.

Off by default (EngineConfig.triton_prologue) until measured on a GPU. It is used on CUDA, and on
the CPU under Triton's interpreter (TRITON_INTERPRET=1, how the tests check it against the torch
layers); head sizes must be powers of two."""

from __future__ import annotations

import functools
import os

import torch

_enabled = False


def enable(on: bool) -> None:
    """Set from EngineConfig.triton_prologue when an engine is built (one engine per process)."""
    global _enabled
    _enabled = on


def applies(qkv: torch.Tensor, head_dim: int) -> bool:
    if not _enabled or head_dim & (head_dim - 1) or not qkv.is_contiguous():
        return False
    if not qkv.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _kernel() is not None


@functools.cache
def _kernel():
    try:
        from worker.layers.prologue_kernel import qkv_prologue_kernel
    except ImportError:  # no Triton here
        return None
    return qkv_prologue_kernel


def qkv_prologue(qkv: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], contiguous. Writes the normed, rotated keys
    and the values at out_loc of k_cache / v_cache ([slots, num_kv_heads, head_dim]); returns the
    normed, rotated queries [T, num_heads, head_dim]. q_weight/k_weight None: no q/k norm."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    has_norm = q_weight is not None
    _kernel()[(tokens, num_heads + num_kv_heads)](
        qkv, positions, out_loc, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
        q, k_cache, v_cache, eps, qkv.stride(0), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm)
    return q
