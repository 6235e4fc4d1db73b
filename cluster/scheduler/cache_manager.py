"""KV-page accounting for the scheduler: prefix matching at admission, reservations so that admitted
requests can always run to their end, allocation (evicting from the prefix cache when short),
hand-over of finished requests' pages to the prefix cache, the prefix cache's KV events, and the
integrity check."""

from __future__ import annotations

import numpy as np

from cluster.scheduler.page_allocator import PageAllocator
from cluster.scheduler.prefix_cache import create_prefix_cache
from cluster.scheduler.req import Req


class IntegrityError(AssertionError):
    pass


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, cache_type: str, decode_reserve_tokens: int) -> None:
        self.page_size = page_size
        self.decode_reserve_tokens = decode_reserve_tokens
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = create_prefix_cache(cache_type, page_size)
        self.caching = cache_type != "naive"
        self.reserved = 0  # pages promised to admitted requests, not allocated yet
        self.prefill_tokens_saved = 0  # prompt tokens found in the prefix cache
        self.prompt_tokens_admitted = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def available(self) -> int:
        """Pages that a new request could still be promised."""
        return self.allocator.num_free + self.prefix_cache.num_evictable - self.reserved

    def admit(self, req: Req, headroom: int = 0) -> bool:
        """Matches the tokens to prefill against the prefix cache and reserves the pages the request
        needs for them and for up to decode_reserve_tokens new tokens. False (and nothing held) when
        they are not available now."""
        ps = self.page_size
        # at least one token must be computed to sample from; a prompt to score is computed whole
        limit = (req.fill_len - 1) // ps * ps
        if req.scores_prompt:
            limit = 0
        handle, pages = self.prefix_cache.match(req.input_ids[:limit])
        self.prefix_cache.lock(handle)
        upto = min(req.max_device_len, req.fill_len + self.decode_reserve_tokens)
        need = max(0, self.pages_for(upto) - len(pages))
        if need + headroom > self.available:
            self.prefix_cache.unlock(handle)
            return False
        req.cache_handle, req.pages = handle, list(pages)
        req.num_cached_pages = len(pages)
        req.cached_len = req.prefix_hit_len = len(pages) * ps
        req.reserved_pages = need
        req.reserve_limit = len(pages) + need
        req.may_outgrow = upto < req.max_device_len
        self.reserved += need
        if not req.num_preempted:  # the hit rate is of prompts, counted at their first admission
            self.prefill_tokens_saved += req.cached_len
            self.prompt_tokens_admitted += req.prompt_len
        return True

    def extra_pages(self, req: Req, upto_len: int) -> int:
        """Pages req needs for every position below upto_len beyond what it has and has reserved."""
        return max(0, self.pages_for(upto_len) - len(req.pages) - req.reserved_pages)

    def allocate(self, req: Req, upto_len: int) -> None:
        """Gives req pages for every position below upto_len: its reserved ones first, then any
        available (the caller has checked `extra_pages` against `available`)."""
        n = self.pages_for(upto_len) - len(req.pages)
        if n <= 0:
            return
        reserved = min(n, req.reserved_pages)
        assert n - reserved <= self.available, "a request allocated pages that are promised to others"
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        req.pages.extend(self.allocator.alloc(n))
        req.reserved_pages -= reserved
        self.reserved -= reserved

    def trim(self, req: Req, kv_len: int) -> None:
        """Gives back req's pages past the first kv_len positions (speculative decoding allocated them
        for proposals that were rejected). Those that came out of its reservation go back to it, so a
        request whose max_tokens fit its reservation still never needs a page beyond it."""
        keep = max(self.pages_for(kv_len), req.num_cached_pages)
        extra = req.pages[keep:]
        if not extra:
            return
        del req.pages[keep:]
        self.allocator.free(extra)
        back = max(0, min(len(extra), req.reserve_limit - len(req.pages) - req.reserved_pages))
        req.reserved_pages += back
        self.reserved += back

    def locations(self, req: Req, start: int, end: int) -> np.ndarray:
        """KV locations of positions [start, end)."""
        pos = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(req.pages, dtype=np.int64)
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).astype(np.int32)

    def cache_prefix(self, req: Req, kv_len: int) -> bool:
        """Hands the request's first kv_len tokens (whole pages) to the prefix cache while it runs on.
        True when some of its pages were replaced by the cache's (its page-table row must be rewritten)."""
        if not self.caching:
            return False
        n = kv_len // self.page_size
        if n <= req.num_cached_pages:
            return False
        handle, cached = self.prefix_cache.insert(req.input_ids[: n * self.page_size], req.pages[:n])
        replaced = self._drop_duplicates(req, cached)
        self.prefix_cache.lock(handle)
        self.prefix_cache.unlock(req.cache_handle)
        req.cache_handle, req.num_cached_pages = handle, n
        return replaced

    def release(self, req: Req, kv_len: int) -> None:
        """A finished or aborted request: its computed whole pages go to the prefix cache, the rest
        back to the free list, and what it had reserved is given back."""
        n = kv_len // self.page_size if self.caching else 0
        if n > req.num_cached_pages:
            handle, cached = self.prefix_cache.insert(req.input_ids[: n * self.page_size], req.pages[:n])
            self._drop_duplicates(req, cached)
        else:
            n = req.num_cached_pages
        self.prefix_cache.unlock(req.cache_handle)
        self.allocator.free(req.pages[n:])
        self.reserved -= req.reserved_pages
        req.pages, req.num_cached_pages, req.cache_handle, req.reserved_pages = [], 0, None, 0

    def _drop_duplicates(self, req: Req, cached: list[int]) -> bool:
        dup = [mine for mine, theirs in zip(req.pages, cached) if mine != theirs]
        self.allocator.free(dup)
        req.pages[: len(cached)] = cached
        return bool(dup)

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) hashes of the prefix cache's blocks since the last call (its KV events)."""
        return self.prefix_cache.take_events()

    def check_integrity(self, live: list[Req]) -> None:
        """free + prefix-cached + held by live requests == all pages, each page in exactly one place."""
        free = self.allocator.free_pages()
        cached = self.prefix_cache.all_pages()
        held = [p for r in live for p in r.pages[r.num_cached_pages :]]
        total = len(free) + len(cached) + len(held)
        everyone = set(free) | set(cached) | set(held)
        if total != self.num_pages or len(everyone) != self.num_pages:
            raise IntegrityError(
                f"page accounting broken: free {len(free)} + prefix cache {len(cached)} + live requests "
                f"{len(held)} = {total}, {len(everyone)} distinct, of {self.num_pages} pages"
            )
        if self.reserved != sum(r.reserved_pages for r in live):
            raise IntegrityError(
                f"reserved pages {self.reserved} != {sum(r.reserved_pages for r in live)} reserved by live requests"
            )
