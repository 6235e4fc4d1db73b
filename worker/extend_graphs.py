"""Eager steps of up to `extend_graph_tokens` tokens (a prompt at low load, a mixed step's chunk) replayed
from piecewise CUDA graphs: launched one op at a time, such a step's 28-odd layers cost the host about
16 ms on an H200's host (about 150 launches and their Python) while the device runs them in 2, so the
time to a short prompt's first token was the host's.

Each token-count bucket holds one graph a piece of the model's forward between two attentions: the
embedding and layer 0 up to its attention's queries, each layer's o_proj, MLP and the next layer's
prologue (norm, qkv, q/k norm, rotary, the KV write), and the last layer's MLP and the final norm. The
attention runs eagerly between the pieces, planned for the step's real tokens as an eager step's is, so
prompts of any lengths and any mix of them in a step share one bucket's graphs. A piece copies its
queries into a static buffer and the next reads the attention's output from another.

A step pads its tokens to the bucket: padded tokens read whatever ids and positions an earlier step
left in the static buffers (every op outside the attention works row by row, so they touch no real
row), write their KV to the scratch page that no request owns, and are never sampled. Under tensor
parallelism every rank captures the same buckets (each piece holds its layers' all-reduces), and the
ranks agree to drop them all where one rank's capture failed."""

from __future__ import annotations

import bisect
import gc
import logging

import torch
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from worker.attention.flashinfer_backend import FlashInferBackend
from worker.models.llama import head_dim_of
from worker.parallel import TPGroup

logger = logging.getLogger(__name__)


def extend_graph_sizes(max_tokens: int) -> list[int]:
    """Powers of two from 16, with the midpoints from 128 (from there a step's GEMMs are near compute-bound:
    it pads by at most half), to max_tokens."""
    sizes, t = [], 16
    while t <= max_tokens:
        sizes.append(t)
        if t >= 128 and t + t // 2 <= max_tokens:
            sizes.append(t + t // 2)
        t *= 2
    if max_tokens >= 1 and (not sizes or sizes[-1] != max_tokens):
        sizes.append(max_tokens)
    return sorted(set(sizes))


def extend_graph_bytes(config: PretrainedConfig, max_tokens: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """What the graphs hold for good, estimated from the model's widths (the engine takes it out of the
    KV cache's budget): the largest bucket's peak of activations (a layer's q, k and v, its gate-up and
    SiLU outputs, four hidden-wide tensors), every bucket's output and the attention's two buffers."""
    if max_tokens <= 0:
        return 0
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim, hidden = head_dim_of(config), config.hidden_size
    inter = getattr(config, "intermediate_size", None) or 4 * hidden  # a config without one: the usual ratio
    per_token = ((heads + 2 * kv_heads) * head_dim + 3 * inter) // tp_size + 4 * hidden
    queries = 2 * heads * head_dim // tp_size
    elements = max_tokens * (per_token + queries) + sum(extend_graph_sizes(max_tokens)) * hidden
    return elements * dtype.itemsize


class _Pieces:
    """One bucket's graphs: graphs[i] runs up to layer_ids[i]'s attention; the last one to the end."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layer_ids: list[int] = []
        self.hidden: torch.Tensor | None = None  # the final norm's output, [bucket, hidden]


class _CutAtAttention:
    """The attention the model sees while a bucket is warmed up or captured: a layer's keys and values
    (from the unfused prologue) go to the cache, its queries into the static buffer, and, capturing, the
    piece ends there and the next begins; the model reads the attention's output from the other buffer."""

    def __init__(self, runner: ExtendGraphs, tokens: int, pieces: _Pieces | None, pool: tuple | None) -> None:
        self.kv, self.out_loc = runner.attn.kv, runner.out_loc[:tokens]
        self.runner, self.tokens, self.pieces, self.pool = runner, tokens, pieces, pool

    def begin(self) -> None:
        if self.pieces is not None:
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool)
            self.pieces.graphs.append(g)

    def end(self) -> None:
        if self.pieces is not None:
            self.pieces.graphs[-1].capture_end()

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int) -> torch.Tensor:
        if k is not None:
            self.kv.store(layer_id, self.out_loc, k, v)
        q_buf, o_buf = self.runner.attention_buffers(q)
        q_buf[: self.tokens].copy_(q)
        if self.pieces is not None:
            self.end()
            self.pieces.layer_ids.append(layer_id)
            self.begin()
        return o_buf[: self.tokens]


class ExtendGraphs:
    def __init__(
        self, model: nn.Module, attn: FlashInferBackend, max_tokens: int, scratch_loc: int, device: torch.device
    ) -> None:
        self.model, self.attn, self.scratch_loc = model, attn, scratch_loc
        self.sizes = extend_graph_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.full((n,), scratch_loc, dtype=torch.int64, device=device)
        self.q: torch.Tensor | None = None  # the attention's queries and output, made at the first warm-up
        self.o: torch.Tensor | None = None
        self.pieces: dict[int, _Pieces] = {}

    def attention_buffers(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q is None:  # outside any capture: the largest bucket's warm-up comes first
            self.q = torch.zeros((self.max_tokens, *q.shape[1:]), dtype=q.dtype, device=q.device)
            self.o = torch.zeros_like(self.q)
        return self.q, self.o

    def bucket(self, tokens: int) -> int:
        """The captured token count that runs a step of `tokens`; 0 when it runs eagerly."""
        if tokens > self.max_tokens:
            return 0
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def capture(self, stream: torch.cuda.Stream, progress: bool = True) -> None:
        pool = torch.cuda.graph_pool_handle()
        gc.collect()  # as torch.cuda.graph does: what awaits the collector leaves the allocator first
        torch.cuda.synchronize()
        # largest first: the smaller buckets' pieces then fit in the memory the largest took from the pool
        for tokens in tqdm(self.sizes[::-1], desc="capturing extend graphs", unit="bucket", disable=not progress):
            with torch.cuda.stream(stream):
                self._forward(_CutAtAttention(self, tokens, None, None), tokens)  # JIT kernels, cuBLAS heuristics
            stream.synchronize()
            pieces = _Pieces()
            cut = _CutAtAttention(self, tokens, pieces, pool)
            with torch.cuda.stream(stream):
                cut.begin()
                try:
                    pieces.hidden = self._forward(cut, tokens)
                finally:
                    cut.end()
            self.pieces[tokens] = pieces

    def _forward(self, cut: _CutAtAttention, tokens: int) -> torch.Tensor:
        return self.model(self.input_ids[:tokens], self.positions[:tokens], cut)

    def run(self, tokens: int, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor) -> torch.Tensor:
        """On the compute stream, the attention planned for the step: its tokens into the static buffers,
        then the bucket's pieces with the attention between them. Returns the real tokens' final hidden
        states (a view of the bucket's output, valid until the next replay)."""
        n, p = input_ids.shape[0], self.pieces[tokens]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_loc[:n].copy_(out_loc)
        if n < tokens:  # rows a longer step left behind would write into its requests' KV cells
            self.out_loc[n:tokens].fill_(self.scratch_loc)
        q, o, attend = self.q[:n], self.o[:n], self.attn.forward
        for graph, layer_id in zip(p.graphs, p.layer_ids):
            graph.replay()
            attend(q, None, None, layer_id, out=o)
        p.graphs[-1].replay()
        return p.hidden[:n]


def extend_graphs_apply(model: nn.Module, max_tokens: int, device: torch.device) -> bool:
    """Whether an engine captures extend graphs (before its attention backend exists: its KV budget
    asks): on a GPU, turned on, and not for a mixture of experts (its prompt steps' expert kernels have
    not been run inside graphs) nor an EAGLE-3 head (its steps read the model's hidden states)."""
    if max_tokens <= 0 or device.type != "cuda" or getattr(model, "takes_hidden", False):
        return False
    from worker.layers.moe.block import SparseMoeBlock

    return not any(isinstance(m, SparseMoeBlock) for m in model.modules())


def capture_extend_graphs(
    model: nn.Module,
    attn: object,
    max_tokens: int,
    scratch_loc: int,
    stream: torch.cuda.Stream,
    device: torch.device,
    tp: TPGroup,
) -> ExtendGraphs | None:
    """The extend graphs, or None where they do not apply (extend_graphs_apply; the torch backend) or
    failed to capture on any rank (logged: the engine then runs those steps eagerly, as before, on every
    rank alike, so the ranks' collectives stay in step)."""
    if not extend_graphs_apply(model, max_tokens, device) or not isinstance(attn, FlashInferBackend):
        return None
    graphs: ExtendGraphs | None = ExtendGraphs(model, attn, max_tokens, scratch_loc, device)
    try:
        with torch.inference_mode():
            graphs.capture(stream, progress=tp.rank == 0)
    except Exception as e:  # a kernel that syncs with the host, an op capture refuses, out of memory
        logger.warning("extend steps run eagerly: their CUDA graphs failed to capture on rank %d (%s)", tp.rank, e)
        graphs = None
    stream.synchronize()
    if tp.size > 1 and tp.comm.min_over_ranks(int(graphs is not None)) == 0:
        if graphs is not None:
            logger.warning("extend steps run eagerly: another rank's CUDA graphs failed to capture")
        graphs = None
    return graphs
