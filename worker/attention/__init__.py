"""Attention backends behind one interface; `create_backend` picks one for the device."""

from __future__ import annotations

import torch

from worker.attention.base import AttentionBackend
from worker.kv_cache import KVCachePool
from worker.stream import HostWaits


def create_backend(
    name: str,
    kv: KVCachePool,
    page_table: torch.Tensor,
    num_heads: int,
    q_dtype: torch.dtype | None = None,
    decode: str = "auto",
    waits: HostWaits | None = None,
    prefill: str = "auto",
    pdl: bool = False,
    merge: str = "auto",
    longest_first: bool = False,
) -> AttentionBackend:
    """name: Kernels.attention; q_dtype: the model's dtype, which the queries have (FlashInfer plans for
    it; None: see FlashInferBackend); decode: Kernels.decode (FlashInfer's decode path); waits: where
    the host's waits are counted (the engine's); prefill: Kernels.prefill (FlashInfer's prefill backend);
    pdl: the Triton decode kernels launched with programmatic dependent launch; merge: Kernels.decode_merge;
    longest_first: Kernels.decode_longest_first."""
    if name == "auto":
        name = "flashinfer" if kv.device.type == "cuda" and _has_flashinfer() else "torch"
    if name == "torch":
        from worker.attention.torch_backend import TorchBackend

        return TorchBackend(kv, page_table)
    if name == "flashinfer":
        from worker.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv, page_table, num_heads, q_dtype, decode, waits, prefill, pdl, merge, longest_first)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or flashinfer")


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
