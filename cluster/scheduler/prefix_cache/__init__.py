"""Prefix caches: which KV pages of earlier requests a new prompt can reuse."""

from __future__ import annotations

from cluster.scheduler.prefix_cache.base import PrefixCache
from cluster.scheduler.prefix_cache.naive import NaiveCache
from cluster.scheduler.prefix_cache.radix import RadixCache


def create_prefix_cache(cache_type: str, page_size: int) -> PrefixCache:
    if cache_type == "radix":
        return RadixCache(page_size)
    if cache_type == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown cache_type {cache_type!r}; choose radix or naive")
