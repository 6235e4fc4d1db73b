"""FlashInfer's fused elementwise kernels (RMSNorm with the residual add, rotary embedding in place,
SiLU-and-multiply), used on CUDA in half precision. Each replaces several small torch kernels: at
small batch a decode step's time is mostly their launches. The torch versions stay as the reference
(CPU, float32), and run where the engine's Kernels.fused is off."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _ops() -> SimpleNamespace | None:
    try:
        from flashinfer.activation import silu_and_mul
        from flashinfer.norm import fused_add_rmsnorm, rmsnorm
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
    except ImportError:
        return None
    return SimpleNamespace(
        rmsnorm=rmsnorm,
        fused_add_rmsnorm=fused_add_rmsnorm,
        silu_and_mul=silu_and_mul,
        rope_inplace=apply_rope_with_cos_sin_cache_inplace,
    )


def fused_ops(x: torch.Tensor) -> SimpleNamespace | None:
    """The fused kernels when they apply to x, else None (use the torch path)."""
    if not x.is_cuda or x.dtype not in _HALF:
        return None
    return _ops()
