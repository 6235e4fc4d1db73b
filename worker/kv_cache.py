"""The paged KV-cache pool: for every layer, keys and values of num_pages * page_size token locations.

A token's location is page * page_size + offset; the page table maps each request's positions to
locations, so pages need not be contiguous."""

from __future__ import annotations

import torch

from worker import triton_ops


class KVCachePool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.buffer = torch.zeros(2, num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if triton_ops.kernels_available(k) and triton_ops.kv_store(loc, k, v, self.k(layer), self.v(layer)):
            return  # one launch for both
        self.buffer[0, layer].index_copy_(0, loc, k)
        self.buffer[1, layer].index_copy_(0, loc, v)
