"""Cost of prefix-cache eviction on the scheduler's CPU path. A long-running server's radix cache
fills the memory the requests leave free, so from then on every page a request allocates is taken
by evicting one: this measures one such eviction against a cache of many cached prompts.

    python bench/prefix_cache_evict.py --prompts 1000 2000 8000
"""

from __future__ import annotations

import argparse
import json
import random
import time

from cluster.scheduler.prefix_cache.radix import RadixCache


def build(num_prompts: int, page_size: int, pages_per_prompt: int, shared_pages: int, seed: int) -> RadixCache:
    """Prompts sharing a system prompt of shared_pages pages, each then its own pages_per_prompt."""
    rng = random.Random(seed)
    cache = RadixCache(page_size)
    system = [rng.randrange(50_000) for _ in range(shared_pages * page_size)]
    next_page = 0
    for _ in range(num_prompts):
        ids = system + [rng.randrange(50_000) for _ in range(pages_per_prompt * page_size)]
        pages = list(range(next_page, next_page + len(ids) // page_size))
        next_page += len(pages)
        cache.insert(ids, pages)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages-per-prompt", type=int, default=8)
    ap.add_argument("--evictions", type=int, default=200)
    ap.add_argument("--json", default="prefix_cache_evict.json")
    args = ap.parse_args()
    rows = []
    for n in args.prompts:
        cache = build(n, args.page_size, args.pages_per_prompt, shared_pages=4, seed=0)
        start = time.perf_counter()
        for _ in range(args.evictions):
            cache.evict(1)
        us = (time.perf_counter() - start) / args.evictions * 1e6
        rows.append({"cached_prompts": n, "cached_pages": cache.num_pages, "evict_one_us": round(us, 1)})
    print(f"{'cached prompts':>15} {'cached pages':>13} {'µs per evict(1)':>16}")
    for r in rows:
        print(f"{r['cached_prompts']:>15} {r['cached_pages']:>13} {r['evict_one_us']:>16}")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
