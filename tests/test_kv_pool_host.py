"""A CPU engine's KV cache: zeroed, in every dtype it stores, without writing its bytes at start (the OS
zeroes each page as it is first touched)."""

from __future__ import annotations

import psutil
import pytest
import torch

from worker.kv_cache import KVCachePool, host_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_pool_starts_zeroed_and_keeps_what_is_stored(dtype):
    pool = KVCachePool(2, 8, 4, 2, 16, dtype, torch.device("cpu"))
    assert pool.buffer.shape == (2, 2, 32, 2, 16) and pool.buffer.dtype == dtype
    assert bool((pool.buffer.float() == 0).all())
    k = torch.full((3, 2, 16), 1.5, dtype=torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype)
    pool.store(1, torch.tensor([0, 5, 31]), k, -k)
    keys, values = pool.gather(1, torch.tensor([5, 6]), torch.float32)
    assert keys[0].eq(1.5).all() and values[0].eq(-1.5).all()
    assert keys[1].eq(0).all() and values[1].eq(0).all()


def test_a_large_host_pool_takes_no_resident_memory_until_it_is_written():
    process = psutil.Process()
    before = process.memory_info().rss
    zeros = host_zeros((2, 16, 1 << 19, 4, 16), torch.float32)  # 4 GiB
    grown = process.memory_info().rss - before
    assert zeros.shape[2] == 1 << 19 and grown < 256 << 20
    zeros[0, 0, :1024].fill_(1.0)
    assert float(zeros[0, 0, :1024].sum()) == 1024 * 4 * 16
