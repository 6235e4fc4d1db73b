"""Triton kernels for steps' small work, where one launch replaces several: the attention prologue
(from the QKV projection's output: RMSNorm on each query and key head for Qwen3, rotary embedding on
both, and the step's keys and values written into the KV cache: about seven kernels a layer
unfused), and sampling with temperature (argmax, softmax, cumulative sum and search over the
vocabulary: two passes of one kernel).

Off by default (EngineConfig.triton_kernels) until measured on a GPU. Used on CUDA, and on the CPU
under Triton's interpreter (TRITON_INTERPRET=1: how the tests check them against the torch paths)."""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

_enabled = False
_interpreted = False  # Triton's interpreter runs the kernels on CPU tensors
_SAMPLE_BLOCK = 4096


def enable(on: bool) -> None:
    """Set from EngineConfig.triton_kernels when an engine is built (one engine per process)."""
    global _enabled, _interpreted
    _enabled = on and _kernels() is not None
    _interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if on and not _enabled:
        log.warning("triton_kernels is on but Triton is not installed: using the torch kernels")


def available(x: torch.Tensor) -> bool:
    return _enabled and (x.is_cuda or _interpreted)


def prologue_applies(qkv: torch.Tensor, head_dim: int) -> bool:
    return not head_dim & (head_dim - 1) and qkv.is_contiguous() and available(qkv)


@functools.cache
def _kernels():
    try:
        from worker import triton_kernels
    except ImportError:  # no Triton here
        return None
    return triton_kernels


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
    _kernels().qkv_prologue_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, positions, out_loc, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
        q, k_cache, v_cache, eps, qkv.stride(0), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm)
    return q


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of logits (float32 [B, V]): its argmax where temperature <= 0, else the token at
    u (in (0, 1)) of the inverse CDF of softmax(logits / temperature), as `worker.sampler` computes it
    with torch (the two may differ where u falls within float rounding of a CDF step)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _kernels().sample_rows_kernel[(rows,)](logits, logits.stride(0), temperature.float().contiguous(),
                                              u.double().contiguous(), out, vocab, BLOCK=_SAMPLE_BLOCK)
    return out
