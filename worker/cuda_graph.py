"""Decode steps replayed from CUDA graphs: the model's forward (embedding, layers, final norm) is
captured once per batch-size bucket at start-up, over static input buffers; a step pads its batch to
the next bucket, fills the buffers and replays. The LM head and sampling stay outside the graph, so
the next step's metadata can be copied and planned while they run.

Padded rows read token 0 at position 0 and write their KV to a scratch page that no request owns."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from worker.attention.flashinfer_backend import FlashInferBackend
from worker.batch import BatchDesc


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32 and every 16 beyond, ending at max_bs."""
    sizes = [bs for bs in (1, 2, 4, 8, 16, 24, 32) if bs <= max_bs]
    sizes += range(48, max_bs + 1, 16)
    if max_bs >= 1 and sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: nn.Module, attn: FlashInferBackend, max_bs: int, scratch_page: int,
                 device: torch.device) -> None:
        self.model, self.attn = model, attn
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.scratch_page = scratch_page
        self.scratch_loc = scratch_page * attn.page_size
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_loc = torch.full((self.max_bs,), self.scratch_loc, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def bucket(self, desc: BatchDesc) -> int:
        """The captured batch size that runs `desc`; 0 when it must run eagerly."""
        if desc.is_prefill or desc.batch_size > self.max_bs:
            return 0
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, desc.batch_size)]

    def capture(self, stream: torch.cuda.Stream, progress: bool = True) -> None:
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one took from the pool
        for bs in tqdm(self.batch_sizes[::-1], desc="capturing CUDA graphs", unit="graph", disable=not progress):
            run = self._forward_fn(bs)
            with torch.cuda.stream(stream):
                self.attn.prepare_graph(None, bs, self.out_loc[:bs], self.scratch_page)
                run()  # warm-up outside the graph: JIT kernels, cuBLAS workspaces, lazily made buffers
            stream.synchronize()
            self.graphs[bs] = self._capture(run, pool, stream)

    def _forward_fn(self, bs: int) -> Callable[[], torch.Tensor]:
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        return lambda: self.model(ids.long(), pos, self.attn)

    @staticmethod
    def _capture(run: Callable[[], torch.Tensor], pool, stream) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            hidden = run()
        return graph.replay, hidden

    def prepare(self, desc: BatchDesc, bs: int, positions: torch.Tensor, out_loc: torch.Tensor) -> None:
        """On the scheduler stream, once the previous step's forward is done with the static buffers:
        copies this step's (padded) positions and KV locations in and plans attention."""
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.out_loc[:bs].copy_(out_loc, non_blocking=True)
        self.attn.prepare_graph(desc, bs, self.out_loc[:bs], self.scratch_page)

    def replay(self, bs: int, token_pool: torch.Tensor, token_read_idx: torch.Tensor, n: int) -> torch.Tensor:
        """On the compute stream: reads the step's input tokens from the token pool (the previous step
        wrote them there) and replays; returns the final hidden states of the `n` real rows."""
        torch.index_select(token_pool.view(-1), 0, token_read_idx, out=self.input_ids[:bs])
        replay, hidden = self.graphs[bs]
        replay()
        return hidden[:n]
