"""Decode steps replayed from CUDA graphs. For every batch-size bucket two graphs are captured at
start-up over static buffers:
- the forward: the input tokens read from the token pool, embedding, layers, final norm;
- the head: the LM head, sampling (greedy rows exactly the argmax; the others the Gumbel-max draw of
  (seed, position), see worker/sampling/sampler.py) and the sampled tokens written into the token pool.
The engine records `inputs_free` between the two replays, so the next step's page table and attention
plan (which the forward reads) are written on the scheduler stream while the head runs.

A step pads its batch to the next bucket, stages its per-row inputs (token-pool read and write cells,
positions, KV locations, seeds, temperatures) as one block (worker/graph_io.py), copies that block into the static
buffer on the compute stream (one copy: the previous step's replays have read it by then) and
replays. A step where some row filters (top-k, top-p, min-p) or uses the logits processors (penalties,
biases, min_tokens) then replays one more graph of its bucket, chosen by which of the two it needs: it
stages those rows' arguments as a second block, redraws every row over the processed and filtered
logits of the head (the same draw: a row that neither filters nor processes gets its token again) and
overwrites the head's tokens; with processors it counts the tokens into the request slots' state. A
step that needs neither pays nothing for them.

Padded rows read token 0 at position 0, write their KV to a scratch page that no request owns and
their token to the token pool's scratch cell; they are greedy (the blocks' pads)."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from worker.attention.flashinfer_backend import FlashInferBackend
from worker.batch import BatchDesc
from worker.graph_io import IO, SAMPLER_IO, io_pads, sampler_io_pads
from worker.sampling.columns import DRAW, FILTER, MIN_P, PROCS, columns_of
from worker.sampling.step_sampler import SampleArgs, StepSampler
from worker.token_table import TokenTable

# the graphs a bucket holds beyond its head, by (processors, filter)
VARIANTS = ((True, False), (False, True), (True, True))


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
        self.io = IO.views(io, bs)
        self.token_read, self.positions, self.out_loc = self.io["token_read"], self.io["positions"], self.io["out_loc"]
        self.token_write, self.sample_pos = self.io["token_write"], self.io["sample_pos"]
        self.bs = bs
        self.forward: Callable[[], None] | None = None
        self.head: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None  # [bs, vocab], the model's dtype
        self.next_tokens: torch.Tensor | None = None  # int32 [bs]
        # the variants, by (processors, filter): their graphs and sampled tokens
        self.resample: dict[tuple[bool, bool], Callable[[], None]] = {}
        self.resampled: dict[tuple[bool, bool], torch.Tensor] = {}
        self.allowed: torch.Tensor | None = None  # [bs, W] int32: grammars' allowed tokens (the runner's buffer)

    def bind_sampler_io(self, sio: torch.Tensor) -> None:
        self.sampler_args = SAMPLER_IO.views(sio, self.bs)

    def args(self, procs: bool, filtered: bool) -> SampleArgs:
        """A variant's arguments (the head's: neither): the draw's columns, then those of the groups it
        applies. Called while capturing, so a bool column's cast from its int64 row is in the graph."""
        groups = (
            {DRAW}
            | ({FILTER} if filtered else set())
            | ({MIN_P} if procs or filtered else set())
            | ({PROCS} if procs else set())
        )
        rows = {**self.io, **self.sampler_args}
        columns = {c.name: rows[c.name].bool() if c.staged.kind == "b" else rows[c.name] for c in columns_of(*groups)}
        return SampleArgs.of(columns, self.sample_pos, self.token_write, self.allowed if procs else None)


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn: FlashInferBackend,
        max_bs: int,
        scratch_page: int,
        table: TokenTable,
        sampler: StepSampler,
        device: torch.device,
    ) -> None:
        self.model, self.attn, self.table, self.sampler = model, attn, table, sampler
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.scratch_page = scratch_page
        self.scratch_loc = scratch_page * attn.page_size
        self.io = torch.zeros(IO.nbytes(self.max_bs), dtype=torch.uint8, device=device)
        self.buckets = {bs: _Bucket(self.io, bs) for bs in self.batch_sizes}
        self.sio = torch.zeros(SAMPLER_IO.nbytes(self.max_bs), dtype=torch.uint8, device=device)
        # grammars' allowed tokens per row (-1: every token), read by the processor variants
        self.allowed = torch.full((self.max_bs, -(-sampler.state.vocab // 32)), -1, dtype=torch.int32, device=device)
        for b in self.buckets.values():
            b.bind_sampler_io(self.sio)
            b.allowed = self.allowed[: b.bs]
        self.pad = io_pads(self.scratch_loc, table.scratch_cell)
        self.sampler_pad = sampler_io_pads(sampler.state.scratch_row)
        self.graphs = self.buckets  # the captured batch sizes (tests look at the keys)
        # an EAGLE-3 head: a row's slot is its token-pool row, that of the cell its sample is written to
        # (a padded row's, past every slot, has a slot of hidden state of its own)
        self.takes_hidden = getattr(model, "takes_hidden", False)

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
                idle = SAMPLER_IO.pack(bs, 0, {}, self.sampler_pad)  # every row padding
                self.sio[: idle.size].copy_(torch.from_numpy(idle))
                self.attn.prepare_graph(None, bs, b.out_loc, self.scratch_page)
                # warm-up outside the graph: JIT kernels, cuBLAS workspaces, lazily made buffers
                logits, _ = self._head(b, self._forward(b))
                for procs, filtered in VARIANTS:
                    self.sampler(logits, b.args(procs, filtered), procs=procs, filtered=filtered)
            stream.synchronize()
            g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1, pool=pool, stream=stream):
                hidden = self._forward(b)
            with torch.cuda.graph(g2, pool=pool, stream=stream):
                b.logits, b.next_tokens = self._head(b, hidden)
            b.forward, b.head = g1.replay, g2.replay
            for procs, filtered in VARIANTS:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    b.resampled[procs, filtered] = self.sampler(
                        b.logits, b.args(procs, filtered), procs=procs, filtered=filtered
                    )
                b.resample[procs, filtered] = g.replay

    def _forward(self, b: _Bucket) -> torch.Tensor:
        ids = self.table.flat_pool.index_select(0, b.token_read)
        if self.takes_hidden:  # an EAGLE-3 head: each row goes on from its slot's last hidden state
            slots = torch.div(b.token_write, self.table.token_pool.shape[1], rounding_mode="floor")
            return self.model(ids.long(), b.positions, self.attn, None, slots, None)
        return self.model(ids.long(), b.positions, self.attn)

    def _head(self, b: _Bucket, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # an EAGLE-3 head's logits over its vocabulary are spread over the model's (compute_logits)
        logits = self.model.compute_logits(hidden) if self.takes_hidden else self.model.lm_head(hidden)
        return logits, self.sampler(logits, b.args(False, False), procs=False, filtered=False)

    def prepare(self, desc: BatchDesc, bs: int, staged: object | None = None) -> None:
        """On the scheduler stream, once the previous step's forward is done with the attention buffers:
        plans attention for this step (`staged`: the backend's `stage` for it, run before)."""
        self.attn.prepare_graph(desc, bs, self.buckets[bs].out_loc, self.scratch_page, staged)

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

    def resample(
        self,
        bs: int,
        sio: torch.Tensor,
        grammar_rows: torch.Tensor | None,
        grammar_mask: torch.Tensor | None,
        *,
        procs: bool,
        filtered: bool,
    ) -> torch.Tensor:
        """On the compute stream, after `replay`: copies the step's second block (and its constrained rows'
        allowed tokens) and replays the variant it needs; its tokens (the first n rows are real) replace
        the head's."""
        self.sio[: sio.numel()].copy_(sio)
        if procs:
            self.allowed[:bs].fill_(-1)
            if grammar_rows is not None:
                self.allowed.index_copy_(0, grammar_rows, grammar_mask)
        b = self.buckets[bs]
        b.resample[procs, filtered]()
        return b.resampled[procs, filtered]
