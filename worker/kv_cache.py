"""The paged KV-cache pool: for every layer, keys and values of num_pages * page_size token locations.

A token's location is page * page_size + offset; the page table maps each request's positions to
locations, so pages need not be contiguous. The pool holds the model's dtype, or float8 e4m3 (half
the bytes of bfloat16: twice the pages for the same memory), converted on store and read back by the
attention backends."""

from __future__ import annotations

import math

import numpy as np
import torch

from worker import triton_ops
from worker.kernels import Kernels

FP8 = torch.float8_e4m3fn
# Keys and values are stored unscaled (a scale of 1.0), saturated to e4m3's largest finite value.
# e4m3 is a float: its relative error (3 mantissa bits) is the same anywhere in its normal range
# 2^-6..448, and a scale only slides that window. The keys and values of the models served here (RMS-
# normed hidden states through projections; Qwen3's k_norm) lie inside it, and no scale can be measured
# before the cache is written: a dynamic one would have to be fixed per page, which FlashInfer's one
# k_scale/v_scale per call cannot express. This is vLLM's and SGLang's default without a calibrated
# checkpoint. Saturating keeps an outlier finite: a plain cast can turn values from 480 up into NaN
# (torch 2.11's does, on CUDA and the CPU), which would poison every query that reads the page.
FP8_MAX = torch.finfo(FP8).max


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (nearest even), saturated at +-448; NaN stays NaN."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages the OS zeroes as they are first touched (calloc, through numpy's
    zeros): a CPU engine's KV cache costs nothing at start, where torch.zeros writes every byte (seconds
    for the default 2 GiB). The bytes are allocated as uint8 and reinterpreted, for dtypes numpy lacks."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCachePool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels = Kernels(),
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.kernels = kernels
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.is_fp8 = dtype == FP8
        shape = (2, num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.buffer = (
            torch.zeros(shape, dtype=dtype, device=device) if self.device.type != "cpu" else host_zeros(shape, dtype)
        )
        # index_copy_ and gathers lack float8 kernels (on the CPU at least): an fp8 pool moves its bytes
        self._cells = self.buffer.view(torch.uint8) if self.is_fp8 else self.buffer

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if triton_ops.kernels_available(self.kernels, k) and triton_ops.kv_store(
            loc, k, v, self.k(layer), self.v(layer)
        ):
            return  # one launch for both
        if self.is_fp8:
            k, v = to_fp8(k).view(torch.uint8), to_fp8(v).view(torch.uint8)
        self._cells[0, layer].index_copy_(0, loc, k)
        self._cells[1, layer].index_copy_(0, loc, v)

    def gather(self, layer: int, locs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at locs (any shape of int64), [*locs.shape, kv_heads, head_dim] each, in dtype."""
        k, v = self._cells[0, layer][locs], self._cells[1, layer][locs]
        if self.is_fp8:
            k, v = k.view(FP8), v.view(FP8)
        return k.to(dtype), v.to(dtype)
