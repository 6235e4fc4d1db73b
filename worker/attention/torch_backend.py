"""The plain-torch paged attention backend: the reference the fast backends are checked against.
It runs anywhere torch does (CPU and CUDA), in any dtype, with grouped-query attention; a float8 KV
cache is read back in the queries' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend
from worker.batch import ForwardBatch
from worker.kv_cache import KVCachePool


class TorchBackend(AttentionBackend):
    def __init__(self, kv: KVCachePool, page_table: torch.Tensor) -> None:
        self.kv = kv
        self.page_table = page_table
        self.batch: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch, staged: object | None = None) -> None:
        self.batch, self.out_loc = batch, batch.out_loc
        desc = batch.desc
        max_len = int(desc.seq_lens.max())
        # every request's KV locations, padded to the longest; masked below
        self.locs = self.page_table[batch.slots, :max_len].long()
        if desc.is_prefill:
            self.spans = []
            start = 0
            for ext, seq in zip(desc.extend_lens.tolist(), desc.seq_lens.tolist()):
                cached = seq - ext
                q_pos = torch.arange(cached, seq, device=self.kv.device).unsqueeze(1)
                mask = torch.arange(seq, device=self.kv.device).unsqueeze(0) <= q_pos
                self.spans.append((start, ext, seq, mask))
                start += ext
        else:
            self.valid = torch.arange(max_len, device=self.kv.device).unsqueeze(0) < batch.seq_lens.unsqueeze(1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        result = self._attend(q, k, v, layer_id)
        return result if out is None else out.copy_(result)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        batch = self.batch
        if k is not None:
            self.kv.store(layer_id, batch.out_loc, k, v)
        if batch.desc.is_prefill:
            out = torch.empty_like(q)
            for i, (start, ext, seq, mask) in enumerate(self.spans):
                keys, values = self.kv.gather(layer_id, self.locs[i, :seq], q.dtype)
                qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
                ki = keys.transpose(0, 1).unsqueeze(0)  # [1, KV, seq, D]
                vi = values.transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
                out[start : start + ext] = o[0].transpose(0, 1)
            return out
        return self._decode(q, *self.kv.gather(layer_id, self.locs, q.dtype))

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        kv_heads = keys.shape[2]
        qg = q.view(b, kv_heads, h // kv_heads, d).float()
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys.float()) * d**-0.5
        scores = scores.masked_fill(~self.valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values.float())
        return out.reshape(b, h, d).to(q.dtype)
