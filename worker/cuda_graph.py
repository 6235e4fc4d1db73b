"""Decode steps replayed from CUDA graphs. For every batch-size bucket two graphs are captured at
start-up over static buffers:
- the forward: the input tokens read from the token pool, embedding, layers, final norm;
- the head: the LM head, sampling (greedy rows exactly the argmax; the others the Gumbel-max draw of
  (seed, position), see worker/sampler.py) and the sampled tokens written into the token pool.
The engine records `inputs_free` between the two replays, so the next step's page table and attention
plan (which the forward reads) are written on the scheduler stream while the head runs.

A step pads its batch to the next bucket, stages its per-row inputs (token-pool read and write cells,
positions, KV locations, seeds, temperatures) as one block, copies that block into the static
buffer on the compute stream (one copy: the previous step's replays have read it by then) and
replays. Top-k/top-p rows are redone eagerly after the head (the tokens they drop masked, the same
draw), overwriting what the head wrote for them.

Padded rows read token 0 at position 0, write their KV to a scratch page that no request owns and
their token to the token pool's scratch cell; they are greedy."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from worker import triton_ops
from worker.attention.flashinfer_backend import FlashInferBackend
from worker.batch import BatchDesc
from worker.sampler import sample_unfiltered
from worker.token_table import TokenTable

# the int64 rows of the per-step block, then one float32 row (temperature)
IO_FIELDS = ("token_read", "positions", "out_loc", "token_write", "seeds", "sample_pos")


def io_bytes(bs: int) -> int:
    return (8 * len(IO_FIELDS) + 4) * bs


def pack_io(bs: int, rows: dict[str, np.ndarray], temperature: np.ndarray, pad: dict[str, int]) -> np.ndarray:
    """The per-step block of a bucket of `bs` rows (uint8, as the static buffer holds it): each int64
    field padded past the real rows with its `pad` value, then the temperatures (0 past them)."""
    block = np.empty(io_bytes(bs), dtype=np.uint8)
    ints = block[: 8 * len(IO_FIELDS) * bs].view(np.int64).reshape(len(IO_FIELDS), bs)
    n = len(temperature)
    for i, name in enumerate(IO_FIELDS):
        ints[i, :n] = rows[name]
        ints[i, n:] = pad.get(name, 0)
    temp = block[8 * len(IO_FIELDS) * bs:].view(np.float32)
    temp[:n] = temperature
    temp[n:] = 0.0
    return block


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32 and every 16 beyond, ending at max_bs."""
    sizes = [bs for bs in (1, 2, 4, 8, 16, 24, 32) if bs <= max_bs]
    sizes += range(48, max_bs + 1, 16)
    if max_bs >= 1 and sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class _Bucket:
    """One batch size's views of the static buffers, its two graphs and their outputs."""

    def __init__(self, io: torch.Tensor, bs: int) -> None:
        ints = io[: 8 * len(IO_FIELDS) * bs].view(torch.int64).view(len(IO_FIELDS), bs)
        for i, name in enumerate(IO_FIELDS):
            setattr(self, name, ints[i])
        self.temperature = io[8 * len(IO_FIELDS) * bs: io_bytes(bs)].view(torch.float32)
        self.bs = bs
        self.forward: Callable[[], None] | None = None
        self.head: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None       # [bs, vocab], the model's dtype
        self.next_tokens: torch.Tensor | None = None  # int32 [bs]


class CudaGraphRunner:
    def __init__(self, model: nn.Module, attn: FlashInferBackend, max_bs: int, scratch_page: int,
                 table: TokenTable, device: torch.device) -> None:
        self.model, self.attn, self.table = model, attn, table
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.scratch_page = scratch_page
        self.scratch_loc = scratch_page * attn.page_size
        self.io = torch.zeros(io_bytes(self.max_bs), dtype=torch.uint8, device=device)
        self.buckets = {bs: _Bucket(self.io, bs) for bs in self.batch_sizes}
        self.pad = {"out_loc": self.scratch_loc, "token_write": table.scratch_cell}
        self.graphs = self.buckets  # the captured batch sizes (tests look at the keys)

    def bucket(self, desc: BatchDesc) -> int:
        """The captured batch size that runs `desc`; 0 when it must run eagerly."""
        if desc.is_prefill or desc.batch_size > self.max_bs:
            return 0
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, desc.batch_size)]

    def capture(self, stream: torch.cuda.Stream, progress: bool = True) -> None:
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one took from the pool
        for bs in tqdm(self.batch_sizes[::-1], desc="capturing CUDA graphs", unit="graph", disable=not progress):
            b = self.buckets[bs]
            with torch.cuda.stream(stream):
                b.out_loc.fill_(self.scratch_loc)
                b.token_write.fill_(self.table.scratch_cell)
                self.attn.prepare_graph(None, bs, b.out_loc, self.scratch_page)
                # warm-up outside the graph: JIT kernels, cuBLAS workspaces, lazily made buffers
                self._head(b, self._forward(b))
            stream.synchronize()
            g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1, pool=pool, stream=stream):
                hidden = self._forward(b)
            with torch.cuda.graph(g2, pool=pool, stream=stream):
                b.logits, b.next_tokens = self._head(b, hidden)
            b.forward, b.head = g1.replay, g2.replay

    def _forward(self, b: _Bucket) -> torch.Tensor:
        ids = self.table.flat_pool.index_select(0, b.token_read)
        return self.model(ids.long(), b.positions, self.attn)

    def _head(self, b: _Bucket, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.lm_head(hidden)
        if triton_ops.kernels_available(logits):
            tokens = triton_ops.sample_rows(logits, b.temperature, b.seeds, b.sample_pos,
                                            token_pool=self.table.flat_pool, token_write=b.token_write)
        else:
            tokens = sample_unfiltered(logits, b.temperature, b.seeds, b.sample_pos).to(torch.int32)
            self.table.flat_pool.index_copy_(0, b.token_write, tokens)
        return logits, tokens

    def prepare(self, desc: BatchDesc, bs: int) -> None:
        """On the scheduler stream, once the previous step's forward is done with the attention buffers:
        plans attention for this step."""
        self.attn.prepare_graph(desc, bs, self.buckets[bs].out_loc, self.scratch_page)

    def replay(self, bs: int, io: torch.Tensor, after_forward: Callable[[], None]) -> _Bucket:
        """On the compute stream: copies the step's block into the static buffer and replays the
        forward, then (after `after_forward`, which records the engine's `inputs_free`) the head.
        The bucket's `logits` and `next_tokens` hold the step's results (the first n rows are real)."""
        b = self.buckets[bs]
        self.io[: io.numel()].copy_(io)
        b.forward()
        after_forward()
        b.head()
        return b
