"""Turning the requests chosen for a step into its batch description: allocating the KV pages the
step writes and advancing each request's state at launch (what lets the overlap loop schedule step
N+1 before step N's tokens are known)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cluster.cache_manager import CacheManager
from cluster.req import Req
from worker.batch import BatchDesc


@dataclass
class Batch:
    """A step as the scheduler sees it: its description, and its requests in the description's order."""

    desc: BatchDesc
    reqs: list[Req]
    emits: list[bool]  # False for a chunk that does not end its prompt: its sample is meaningless


class BatchBuilder:
    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        # request slots whose page-table row changed on the host, written by the next step
        self.rewrite_rows: dict[int, Req] = {}

    def prefill(self, chosen: list[tuple[Req, int]]) -> Batch:
        """A prefill step over (request, tokens to compute) pairs."""
        reqs, emits, ids, locs, seq_lens = [], [], [], [], []
        for req, ext in chosen:
            start, end = req.cached_len, req.cached_len + ext
            self.cache.allocate(req, end)
            if start == req.prefix_hit_len and start > 0:
                self.rewrite_rows[req.table_idx] = req
            if req.scheduled is None:
                req.scheduled = time.perf_counter()
            ids.append(req.input_ids[start:end])
            locs.append(self.cache.locations(req, start, end))
            seq_lens.append(end)
            req.cached_len = end
            done = end == req.fill_len
            if done:  # the prompt's last token samples the first output token (the next, after a preemption)
                req.device_len = req.fill_len + 1
            reqs.append(req)
            emits.append(done)
        desc = self._desc(True, reqs, seq_lens, [len(x) for x in ids], np.concatenate(locs),
                          np.fromiter((t for x in ids for t in x), dtype=np.int32))
        return Batch(desc, reqs, emits)

    def decode(self, reqs: list[Req]) -> Batch:
        locs = np.empty(len(reqs), dtype=np.int32)
        seq_lens = []
        for i, req in enumerate(reqs):
            pos = req.cached_len
            self.cache.allocate(req, pos + 1)
            page = req.pages[pos // self.cache.page_size]
            locs[i] = page * self.cache.page_size + pos % self.cache.page_size
            req.cached_len += 1
            req.device_len += 1
            seq_lens.append(req.cached_len)
        return Batch(self._desc(False, reqs, seq_lens, [1] * len(reqs), locs, None), reqs, [True] * len(reqs))

    def launched(self) -> None:
        """The last batch built reached the device, and with it the page-table rows it rewrote."""
        self.rewrite_rows.clear()

    def failed(self, batch: Batch) -> None:
        """The last batch built never ran: its requests' KV for this step was not computed, so none of
        it may reach the prefix cache when they are freed (its rewrites stay pending for the next step)."""
        for req, seq_len, ext in zip(batch.reqs, batch.desc.seq_lens.tolist(), batch.desc.extend_lens.tolist()):
            req.cached_len = seq_len - ext

    def _desc(self, is_prefill: bool, reqs: list[Req], seq_lens: list[int], extend_lens: list[int],
              out_loc: np.ndarray, input_ids: np.ndarray | None) -> BatchDesc:
        params = [r.params for r in reqs]
        # a request that has left its row since (ended or preempted) needs no rewrite
        rows = [(slot, self.cache.locations(r, 0, r.num_cached_pages * self.cache.page_size))
                for slot, r in self.rewrite_rows.items() if r.table_idx == slot]
        want = [p.logprobs for p in params if p.logprobs is not None]
        return BatchDesc(
            is_prefill=is_prefill,
            table_idx=np.fromiter((r.table_idx for r in reqs), dtype=np.int32, count=len(reqs)),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            extend_lens=np.asarray(extend_lens, dtype=np.int32),
            out_loc=out_loc, input_ids=input_ids,
            temperature=np.fromiter((p.temperature for p in params), dtype=np.float32, count=len(reqs)),
            top_p=np.fromiter((p.top_p for p in params), dtype=np.float32, count=len(reqs)),
            top_k=np.fromiter((p.top_k for p in params), dtype=np.int32, count=len(reqs)),
            seeds=np.fromiter((r.seed for r in reqs), dtype=np.int64, count=len(reqs)),
            prefix_rows=rows, top_logprobs=max(want) if want else -1)
