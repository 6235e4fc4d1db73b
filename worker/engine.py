"""One rank's engine: holds the model, KV cache, token pool and page table, and executes batch
descriptions. It knows nothing of requests or scheduling; every rank applies the same description.

A step runs on two CUDA streams. The scheduler stream copies the step's metadata to the device (one
copy from pinned staging), writes the page table and stages the attention plan's arrays, all of which
the step in flight does not read, so they overlap its forward; then it waits for that step's forward
(`inputs_free`), the last reader of the attention buffers, and plans attention into them, which
overlaps that step's LM head and sampling. The compute stream waits for it, runs the forward (a CUDA graph for
decode), samples, writes the sampled tokens into the token pool and copies them to the host. Nothing
here synchronizes the device; the host waits only on `StepOutput.done`. A step that verifies proposed
tokens (speculative decoding: `desc.spec_lens`) samples at every proposal's position and counts on the
device how many samples each row keeps (sampling/verify.py). It runs as a decode step of one row per
sample (verify_rows.py), replayed from a CUDA graph where one fits, or, where its penalties count the
proposals before each sample, as an extend step, eagerly."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from worker import triton_ops
from worker.attention import create_backend
from worker.batch import BatchDesc, ForwardBatch, StepOutput, desc_columns
from worker.checkpoint_error import folder_problem
from worker.config import EngineConfig
from worker.draft_budget import draft_memory
from worker.extend_graphs import capture_extend_graphs, extend_graph_bytes, extend_graphs_apply
from worker.gemm_tuning import tune_decode_gemms
from worker.graph_io import IO
from worker.kernel_builds import serialize_flashinfer_builds
from worker.kv_cache import KVCachePool
from worker.layers.linear import linears_made_in
from worker.layers.moe.block import SparseMoeBlock
from worker.layers.moe.fused import fused_applies
from worker.layers.moe.weights import experts_made_in
from worker.loader import CheckpointError, init_dummy_weights, load_weights
from worker.model_context import served_context, sliding_window_of
from worker.models import build_model
from worker.models.eagle3 import has_own_embeddings, is_eagle3, keep_hidden_states
from worker.parallel import TPGroup
from worker.quant.experts import (
    attach_expert_scales,
    dequantize_experts,
    expert_modules,
    keep_expert_scales,
    quantize_experts,
    quantize_while_loading,
)
from worker.quant.loading import check_quantized_while_loading, quantize_linears_while_loading
from worker.quant.prepare import check_device, quantize_linears, quantize_lm_head
from worker.quant.scheme import QuantizationError, scheme_of
from worker.sampling.inputs import SamplingInputs, stage_sampling
from worker.sampling.logprobs import prompt_logprobs, token_logprobs
from worker.sampling.processors import ProcessorState
from worker.sampling.resample import redraw
from worker.sampling.step_sampler import SampleArgs, StepSampler
from worker.sampling.verify import SpecRows, spec_rows
from worker.staging import PinnedStaging, Staged, upload_record
from worker.startup import StartupTimes, timed
from worker.stream import HostWaits, new_event, new_stream, use_stream
from worker.token_table import TokenTable
from worker.verify_rows import DecodeVerify, verify_as_decode

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from worker.cublaslt import TunedProduct
    from worker.cuda_graph import CudaGraphRunner

A = TypeVar("A")  # np.ndarray on the host, torch.Tensor once staged

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def load_hf_config(model_path: str) -> PretrainedConfig:
    path = Path(model_path)
    if (problem := folder_problem(model_path)) is not None:
        raise CheckpointError(problem)
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from e


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        return _DTYPES[found] if isinstance(found, str) else found
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class StepInputs(Generic[A]):
    """One step's arrays as `Engine._stage` uploads them (numpy on the host, then their device views;
    None: not needed by this kind of step), its sampling's among them."""

    page_idx: A  # int64 [T]: page-table cells this step fills ...
    page_val: A  # int32 [T]: ... with these KV locations
    sampling: SamplingInputs[A]
    prefix_idx: A | None = None  # page-table cells of prefix-cache hits, and their locations
    prefix_val: A | None = None
    graph_io: A | None = None  # uint8: a graph-replayed decode step's per-row block (worker/graph_io.py IO)
    # eager steps
    slots: A | None = None  # int64 [B]
    seq_lens: A | None = None  # int32 [B]
    positions: A | None = None  # int64 [T]
    out_loc: A | None = None  # int64 [T]
    last_idx: A | None = None  # int64 [B] (prefill): each request's last new token in [T]
    input_ids: A | None = None  # int32 [T] (prefill)
    token_idx: A | None = None  # int64 (prefill): token-pool cells of the prompt tokens given
    token_read: A | None = None  # int64 [B] (decode) or [T] (mixed): token-pool cells of the inputs
    spec: SpecRows | None = None  # a step that verifies proposals: where each row samples
    # a verify step run as decode rows: the token-pool cells its proposals fill, and the proposals
    pool_cells: A | None = None  # int64 [P]
    pool_tokens: A | None = None  # int32 [P]
    hidden_loc: A | None = None  # int64 [T]: an EAGLE-3 head's extend step: the model's hidden states' cells
    staged: Staged | None = None  # the device twin's slot: release(stream) once the step's last reader is enqueued


class Engine:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, beside: Engine | None = None) -> None:
        """`beside`: for an EAGLE-3 head's engine, rank 0's engine of the model it drafts for (built with
        the head as its draft_model), whose token embeddings and hidden states the head reads."""
        self.config = config
        self.beside = beside
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        # this engine's kernels, handed to what it builds: its model's layers, KV cache, sampler, attention
        self.kernels = config.kernels
        triton_ops.warn_if_absent(self.kernels, self.device)
        if self.device.type == "cuda":
            serialize_flashinfer_builds()
        self.host_waits = HostWaits()  # every wait of this engine's host on its device
        self.hf_config = load_hf_config(config.model_path)
        self.kernels = self.kernels.with_model(tp_size=self.tp.size)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        window = None if config.drafts else sliding_window_of(self.hf_config)
        self.max_seq_len, cut = served_context(config.max_seq_len, self.hf_config.max_position_embeddings, window)
        if cut:
            logger.warning(
                "serving at most %d tokens a sequence: this model's attention is windowed to them (sliding_window), "
                "which equals full attention only up to the window",
                self.max_seq_len,
            )
        self.page_size = config.page_size
        # cuda_graph_max_bs 0 turns every CUDA graph off, the extend steps' too
        self.extend_graph_tokens = config.extend_graph_tokens if config.cuda_graph_max_bs > 0 else 0
        self.startup = StartupTimes()
        with timed(self.startup, "weights_s", self.device):
            self._build_model()
        with timed(self.startup, "graphs_s", self.device):  # the graphs' products, before the KV cache
            self.gemm_tuning = self._tune_gemms()
        with timed(self.startup, "kv_cache_s", self.device):
            self._allocate()
        with timed(self.startup, "graphs_s", self.device):
            self.graphs = self._capture_graphs()
            self.extend_graphs = capture_extend_graphs(
                self.model,
                self.attn,
                self.extend_graph_tokens,
                self.scratch_page * self.page_size,
                self.stream,
                self.device,
                self.tp,
            )
        with timed(self.startup, "warm_up_s", self.device):
            self._warm_up()
        if self.tp.rank == 0:
            logger.info("engine ready in %s", self.startup)

    def _build_model(self) -> None:
        if self.config.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {self.config.load_format!r}; choose auto or dummy")
        scheme = scheme_of(self.hf_config, self.config.quantization)
        if scheme is not None:
            check_device(scheme, self.device)
            if scheme.static_activations and self.tp.rank == 0:
                logger.warning(
                    "this FP8 checkpoint's static activation scales (input_scale) are not read: activations are "
                    "quantized per token as they run, each token at its own scale"
                )
        elif self.config.quantize_lm_head:
            raise QuantizationError(
                "quantize_lm_head takes FP8 weights: pass quantization fp8, or serve an FP8 checkpoint"
            )
        dummy = self.config.load_format == "dummy"
        prequantized = scheme is not None and scheme.prequantized and not dummy
        self.kernels = self.kernels.with_weights(quantized_at_load=not prequantized)
        if is_eagle3(self.hf_config):  # a head shares the model's embeddings unless it has its own
            self.hf_config.embed_tokens_in_checkpoint = not dummy and has_own_embeddings(self.config.model_path)
        # a mixture's experts stay FP8 where the fused expert kernels run them (worker/quant/experts.py): a
        # checkpoint's, FP8 or quantized as it loads, are made e4m3 from the start
        fp8_experts = fused_applies(self.kernels, torch.empty(0, device=self.device))
        quantized_loading = scheme is not None and not scheme.prequantized and not dummy
        made_in = torch.float8_e4m3fn if fp8_experts and (prequantized or quantized_loading) else None
        # and an unquantized checkpoint's linears quantized as it loads are made e4m3 too
        linears_in = torch.float8_e4m3fn if quantized_loading else None
        with (
            _default_dtype(self.dtype),
            torch.device(self.device),
            experts_made_in(made_in),
            linears_made_in(linears_in),
        ):
            self.model = build_model(self.hf_config, self.max_seq_len + 1, self.tp, self.kernels)
        # a prequantized checkpoint's fp8 weights and scales load into FP8 linears; an unquantized checkpoint
        # is quantized as it loads (worker/quant/loading.py), random weights (dummy) once drawn
        fold = self.kernels.fp8_norms_resolved == "folded"
        at_load = None if scheme is None else replace(scheme, block=None, prequantized=False)
        if prequantized:
            quantize_linears(self.model, scheme)
            attach_expert_scales(self.model, scheme, keep_fp8=fp8_experts, dtype=self.dtype)
        if quantized_loading:
            quantize_linears_while_loading(self.model, at_load, self.dtype, fold_norms=fold)
            if fp8_experts:
                quantize_while_loading(self.model, self.dtype)
        if dummy:
            init_dummy_weights(self.model)
        else:
            load_weights(self.model, Path(self.config.model_path), progress=self.tp.rank == 0)
        if quantized_loading:
            check_quantized_while_loading(self.model)
        if prequantized:
            keep_expert_scales(self.model, scheme)
            if dequantize_experts(self.model, scheme) and self.tp.rank == 0:
                logger.warning(
                    "this FP8 checkpoint's experts (some or all) are dequantized to %s at load (%s): they take the "
                    "memory of an unquantized checkpoint's experts",
                    self.dtype,
                    "their blocks do not fit the FP8 expert kernels' column groups at this tp_size, or the "
                    "checkpoint leaves one of a block's two projections unquantized"
                    if fp8_experts
                    else "the torch loop over experts computes in the model's dtype",
                )
        if scheme is not None and (dummy or not scheme.prequantized):
            quantize_linears(self.model, at_load, fold_norms=fold)  # those not quantized as they loaded
            if fp8_experts:
                quantize_experts(self.model, scheme)
            elif expert_modules(self.model) and self.tp.rank == 0:
                logger.warning(
                    "FP8 quantization at load leaves a mixture's experts in %s where the torch loop runs them "
                    "(the fused expert kernels run FP8 experts: CUDA, or Triton's interpreter)",
                    self.dtype,
                )
        if self.config.quantize_lm_head:
            quantize_lm_head(self.model)
        if scheme is not None and self.device.type == "cuda":
            # the unquantized weights' memory back to the device (the experts' replaced after the linears'
            # were), for the KV cache's budget, which counts what the device has free
            torch.cuda.empty_cache()
        self.model.eval()
        # an EAGLE-3 head: its steps take hidden states of the model's or its own (worker/models/eagle3.py)
        self.takes_hidden = getattr(self.model, "takes_hidden", False)
        if self.takes_hidden:  # before its CUDA graphs are captured
            if self.beside is None:
                raise CheckpointError(
                    f"{self.config.model_path} is an EAGLE-3 draft head: it runs beside its model "
                    "(speculative_method eagle3, speculative_model: this folder), not on its own"
                )
            self.model.attach(self.beside)

    def _allocate(self) -> None:
        """The KV cache (with what memory the model left), the token pool and page table, the sampler's
        state, the attention backend and the streams."""
        config = self.config
        attn0 = self.model.model.layers[0].self_attn
        # before the KV cache takes what memory is left
        self.proc_state = ProcessorState(
            config.max_running_reqs, self.hf_config.vocab_size, config.max_logit_bias, self.device
        )
        # every rank must hold the pages rank 0 hands out; free memory can differ a little per GPU
        self.num_pages = config.num_pages or self.tp.comm.min_over_ranks(
            self._pages_from_budget(attn0.num_kv_heads, attn0.head_dim)
        )
        # one page more than the scheduler hands out: the scratch page that padded graph rows write to
        self.scratch_page = self.num_pages
        self.kv = KVCachePool(
            self.hf_config.num_hidden_layers,
            self.num_pages + 1,
            self.page_size,
            attn0.num_kv_heads,
            attn0.head_dim,
            self.kv_dtype,
            self.device,
            self.kernels,
        )
        # a row per decode row (the attention plans' buffers are as many): slots, or a verify step's samples
        self.table = TokenTable(config.max_decode_rows, self.max_seq_len, self.device)
        self.sampler = StepSampler(self.table.flat_pool, self.proc_state, self.kernels)
        backend = self.kernels.attention
        if backend == "auto" and self.dtype == torch.float32:
            backend = "torch"  # FlashInfer has no float32 kernels
        self.attn = create_backend(
            backend,
            self.kv,
            self.table.page_table,
            attn0.num_heads,
            q_dtype=self.dtype,
            decode=self.kernels.decode,
            prefill=self.kernels.prefill,
            waits=self.host_waits,
            pdl=triton_ops.pdl_applies(self.kernels, self.device),
            merge=self.kernels.decode_merge,
            longest_first=self.kernels.decode_longest_first,
        )
        self.stream = new_stream(self.device)  # compute
        self.sched_stream = new_stream(self.device)  # metadata copies and attention planning
        self.inputs_free = new_event(self.device)  # the last step's forward no longer reads its inputs
        self.staging = PinnedStaging(self.device, waits=self.host_waits)
        if self.takes_hidden:  # each slot's last hidden state,
            # and one more for a decode graph's padded rows (their token-pool cell is past every slot's)
            self.model.allocate_state(self.table.token_pool.shape[0] + 1)
        # with an EAGLE-3 head beside it (rank 0): the model's hidden states the head reads, at every KV cell
        self.aux_hidden = None
        if config.draft_model is not None and is_eagle3(head := load_hf_config(config.draft_model)):
            cells = (self.num_pages + 1) * self.page_size
            self.aux_hidden = keep_hidden_states(
                self.model, head, config.draft_model, cells, config.load_format == "dummy"
            )
        # optional, for benchmarks: an object with begin(stream, desc) and end(stream) (the compute
        # stream's step), sched_begin(stream) and sched_end(stream) (the scheduler stream's part of it)
        self.step_timer = None
        # a verify step that replays() turned into decode rows, and those rows: the forward of that step
        # (a tensor-parallel rank 0 asks replays first) takes them instead of converting it again
        self._replayed_verify: tuple[BatchDesc, DecodeVerify | None] | None = None

    def _warm_up(self) -> None:
        """One sampled prefill step of one token into the scratch page, on every rank alike (its
        collectives too): what the first request would otherwise wait for (FlashInfer's prefill
        kernels, Triton kernels: compiled on first use, a minute on a fresh host) happens here, before
        the replica takes traffic and before rank 0's watchdog times steps."""

        if self.device.type == "cuda":  # the prologue's other tiles (a one-token step runs the first)
            self.model.model.layers[0].self_attn.warm_prologue(
                self.attn, self.scratch_page * self.page_size, self.dtype
            )
            # the experts' kernels at every block height a step can take, once for each kind of experts the
            # layers hold (the layers share shapes; FP8 experts' kernels, and their scale groups, are variants)
            warmed = set()
            for moe in (m for m in self.model.modules() if isinstance(m, SparseMoeBlock)):
                scales = moe.experts.scales()
                kind = None if scales is None else (scales.gate_up_group, scales.down_group)
                if kind not in warmed:
                    warmed.add(kind)
                    moe.warm_kernels()

        def one(value, dtype):
            return np.array([value], dtype=dtype)

        desc = BatchDesc(
            True,
            slots=one(0, np.int32),
            seq_lens=one(1, np.int32),
            extend_lens=one(1, np.int32),
            out_loc=one(self.scratch_page * self.page_size, np.int32),
            input_ids=one(0, np.int32),
            temperature=one(0.5, np.float32),
            top_p=one(1.0, np.float32),
            top_k=one(-1, np.int32),
            seeds=one(0, np.int64),
        )
        self.forward(desc).done.synchronize()

    def _pages_from_budget(self, kv_heads: int, head_dim: int) -> int:
        per_page = KVCachePool.bytes_per_page(
            self.hf_config.num_hidden_layers, self.page_size, kv_heads, head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            # the extend graphs' activations, captured after the cache, stay for good
            if extend_graphs_apply(self.model, self.extend_graph_tokens, self.device):
                budget -= extend_graph_bytes(self.hf_config, self.extend_graph_tokens, self.dtype, self.tp.size)
        else:
            budget = self.config.cpu_kv_cache_gb * 2**30
        if self.config.draft_model is not None:  # a draft's weights and as many pages of its cache go beside
            draft = draft_memory(
                self.config.draft_model, self.dtype, self.kv_dtype, self.page_size, self.extend_graph_tokens
            )
            budget -= draft.weight_bytes + draft.graph_bytes if self.device.type == "cuda" else 0
            per_page += draft.bytes_per_page
        # there is no use for more pages than every slot filled to the context length
        most = self.config.max_running_reqs * -(-self.max_seq_len // self.page_size)
        pages = min(int(budget // per_page), most)
        if pages < 1:
            raise MemoryError(
                f"no memory left for the KV cache ({budget / 2**30:.2f} GiB budget, "
                f"{per_page} bytes a page); lower max_running_reqs or raise the memory budget"
            )
        return pages

    def _tune_gemms(self) -> list[TunedProduct]:
        """cuBLASLt's algorithms timed for the model's linear products at the CUDA graphs' batch sizes
        (worker/gemm_tuning.py); none without graphs."""
        max_bs = self._graph_max_bs()
        if max_bs <= 0:
            return []
        from worker.cuda_graph import graph_batch_sizes

        sizes = graph_batch_sizes(max_bs)
        return tune_decode_gemms(self.model, self.kernels, sizes, self.dtype, self.device, self.tp.rank == 0)

    def _graph_max_bs(self) -> int:
        """The largest decode batch the CUDA graphs take (0: no graphs, as on the CPU)."""
        if self.device.type != "cuda":
            return 0
        return min(self.config.cuda_graph_max_bs, self.config.max_decode_rows)

    def _capture_graphs(self) -> CudaGraphRunner | None:
        max_bs = self._graph_max_bs()
        if max_bs <= 0:
            return None
        from worker.attention.flashinfer_backend import FlashInferBackend

        if not isinstance(self.attn, FlashInferBackend):
            return None  # the torch backend's shapes change with every step's lengths
        from worker.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(
            self.model, self.attn, max_bs, self.scratch_page, self.table, self.sampler, self.device
        )
        with torch.inference_mode():
            graphs.capture(self.stream, progress=self.tp.rank == 0)
        return graphs

    # -- one step --------------------------------------------------------------------------------

    def _stage(self, desc: BatchDesc, bs: int, verify: DecodeVerify | None = None) -> StepInputs[torch.Tensor]:
        """Packs every array the step needs into pinned staging and copies it to the device (on the
        current stream). `bs` > 0: a decode step replayed from the graph of that batch size, whose
        per-row inputs travel as one block (`graph_io`, and `sampling.sampler_io` when it filters or
        processes). `verify`: `desc` holds a verify step's samples as decode rows."""
        slots = desc.slots.astype(np.int64)
        seq = desc.seq_lens.astype(np.int64)
        pool_row = self.table.token_pool.shape[1]
        if desc.is_prefill:
            ext = desc.extend_lens.astype(np.int64)
            ends = np.cumsum(ext)
            positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(seq - ends, ext)
            token_slots = np.repeat(slots, ext)
        else:
            positions, token_slots = seq - 1, slots
        sample_pos, columns = seq, desc_columns(desc)
        spec = None
        if desc.spec_lens is not None:  # every row samples at its last spec_len + 1 positions
            spec = spec_rows(desc.spec_lens, desc.seq_lens, ends, desc.input_ids)
            sample_pos, slots_of = spec.sample_pos, slots[spec.rows]
            columns = {name: values[spec.rows] for name, values in columns.items()}
        else:
            slots_of = slots
        token_write = slots_of * pool_row + sample_pos  # where each sampled token goes
        draw_pos = sample_pos + desc.sample_shift  # the position whose noise each sample draws with
        s = StepInputs(
            page_idx=token_slots * self.max_seq_len + positions,
            page_val=desc.out_loc.astype(np.int32),
            # a verify step whose processors count proposals draws eagerly after its graph (verify_rows.py)
            sampling=stage_sampling(
                desc, columns, 0 if verify and verify.counts else bs, draw_pos, token_write, self.proc_state
            ),
            spec=spec,
        )
        if verify is not None:
            s.spec, s.pool_cells, s.pool_tokens = verify.spec, verify.pool_cells, verify.pool_tokens
        if desc.hidden_loc is not None:
            s.hidden_loc = desc.hidden_loc.astype(np.int64)
        if desc.prefix_slots:
            s.prefix_idx = np.concatenate(
                [slot * self.max_seq_len + np.arange(len(locs)) for slot, locs in desc.prefix_slots]
            )
            s.prefix_val = np.concatenate([locs for _, locs in desc.prefix_slots]).astype(np.int32)
        if bs:
            s.graph_io = IO.pack(
                bs,
                desc.batch_size,
                {
                    "token_read": slots * pool_row + seq - 1,
                    "positions": positions,
                    "out_loc": desc.out_loc,
                    "token_write": token_write,
                    "sample_pos": seq + desc.sample_shift,
                    **columns,
                },
                self.graphs.pad,
            )
        else:
            s.slots, s.seq_lens, s.positions = slots, desc.seq_lens.astype(np.int32), positions
            s.out_loc = desc.out_loc.astype(np.int64)
            if desc.is_prefill:
                cells = token_slots * pool_row + positions
                given = desc.input_ids >= 0  # a mixed step's decode rows (-1) read their input from the pool
                if given.all():
                    s.input_ids, s.token_idx = desc.input_ids.astype(np.int32), cells
                else:
                    s.input_ids, s.token_idx, s.token_read = desc.input_ids[given].astype(np.int32), cells[given], cells
                s.last_idx = ends - 1 if spec is None else spec.last_idx
            else:
                s.token_read = slots * pool_row + seq - 1
        s.staged = upload_record(self.staging, s)  # s now holds the device views
        return s

    def _verify_rows(self, desc: BatchDesc) -> DecodeVerify | None:
        max_rows, pool_row = self.table.token_pool.shape  # the attention plans' buffers hold as many rows
        return verify_as_decode(desc, self.proc_state.scratch_row, pool_row, max_rows)

    def replays(self, desc: BatchDesc) -> bool:
        """Whether `forward(desc)` runs the step's collectives inside CUDA graphs (a decode graph, or the
        extend graphs), where the communicator does not see them: a tensor-parallel rank 0 then sends
        the step before launching it. Mirrors forward's choices."""
        if desc.spec_lens is not None:
            verify = self._verify_rows(desc)
            self._replayed_verify = (desc, verify)  # forward(desc) takes it from here
            desc = verify.desc if verify is not None else desc
        if self.graphs is not None and self.graphs.bucket(desc):
            return True
        return self.extend_graphs is not None and self.extend_graphs.bucket(desc.num_tokens) > 0

    @torch.inference_mode()
    def forward(self, desc: BatchDesc) -> StepOutput:
        """Launches one step and returns at once; `StepOutput.done` marks when the sampled tokens have
        reached the host."""
        verify = None
        if desc.spec_lens is not None:  # as decode rows where it can: a graph replays those
            asked, self._replayed_verify = self._replayed_verify, None
            verify = asked[1] if asked is not None and asked[0] is desc else self._verify_rows(desc)
            desc = verify.desc if verify is not None else desc
        bs = self.graphs.bucket(desc) if self.graphs is not None else 0
        with use_stream(self.sched_stream):
            # first what the step in flight does not read, so that it overlaps that step's forward: the
            # step's metadata (into a staging slot of its own)
            s = self._stage(desc, bs, verify)
        try:
            return self._launch(desc, bs, verify, s)
        except BaseException:
            # a step that fails once its arrays hold a staging slot gives the slot back, after what it
            # enqueued; else the ring's next turn to that slot would fail every step after
            self.stream.wait_stream(self.sched_stream)
            s.staged.release(self.stream)
            raise

    def _launch(self, desc: BatchDesc, bs: int, verify: DecodeVerify | None, s: StepInputs[torch.Tensor]) -> StepOutput:
        """forward's launches over its staged arrays `s`: `bs`, the decode graph's batch (0: eager)."""
        n, pages = desc.num_tokens, self.table.page_table.view(-1)
        timer = self.step_timer
        with use_stream(self.sched_stream):
            # its cells of the page table (read by this stream alone, by the attention plans), the
            # attention plan's arrays
            pages.index_copy_(0, s.page_idx, s.page_val)
            if s.prefix_idx is not None:
                pages.index_copy_(0, s.prefix_idx, s.prefix_val)
            plan = self.attn.stage(desc, bs or desc.batch_size)
            # then what it reads (the attention buffers the plan rewrites), once its forward is done
            self.sched_stream.wait_event(self.inputs_free)
            if timer is not None:
                timer.sched_begin(self.sched_stream)
            if bs:
                self.graphs.prepare(desc, bs, plan)
            else:
                # a decode step's input_ids are read from the token pool on the compute stream, below
                batch = ForwardBatch(
                    desc=desc,
                    input_ids=s.input_ids,
                    positions=s.positions[:n],
                    out_loc=s.out_loc[:n],
                    slots=s.slots,
                    seq_lens=s.seq_lens,
                    last_idx=s.last_idx,
                )
                self.attn.prepare(batch, plan)
            if timer is not None:
                timer.sched_end(self.sched_stream)
        with use_stream(self.stream):
            self.stream.wait_stream(self.sched_stream)
            if self.step_timer is not None:
                self.step_timer.begin(self.stream, desc)
            # before this step samples (and after the last step that counted into these slots)
            if s.sampling.init is not None:
                self.proc_state.apply_init(s.sampling.init)
            if s.pool_cells is not None:  # a verify step's proposals, where its decode rows read their inputs
                self.table.flat_pool.index_copy_(0, s.pool_cells, s.pool_tokens)
            counts = verify is not None and verify.counts
            if bs:
                logits, next_tokens = self._replay(desc, bs, s, counts)
                scored = None
            else:
                logits, next_tokens, scored = self._forward_eager(desc, batch, s, counts)
            out = self._to_host(next_tokens, logits, desc.top_logprobs)
            if scored is not None:
                chosen, values, ids = scored
                out.prompt_logprobs = self._host_copy(chosen)
                if values is not None:
                    out.prompt_top_logprobs, out.prompt_top_ids = self._host_copy(values), self._host_copy(ids)
            out.done.record(self.stream)
            s.staged.release(self.stream)
            if self.step_timer is not None:
                self.step_timer.end(self.stream)
            return out

    def _replay(
        self, desc: BatchDesc, bs: int, s: StepInputs[torch.Tensor], counts: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays a decode step's graph. `counts`: its rows are a verify step's samples whose processors
        count the proposals before each: drawn again, eagerly, with those counted (the graph's own draw,
        without processors, is overwritten in the token pool)."""
        b = self.graphs.replay(bs, s.graph_io, lambda: self.inputs_free.record(self.stream))
        n, sp = desc.batch_size, s.sampling
        next_tokens = b.next_tokens
        if counts:
            args = _verify_args(sp.args(s.spec.sample_pos, n), s.spec)
            return b.logits[:n], self.sampler(b.logits[:n], args, procs=True, filtered=sp.filtered)
        if sp.redraw is not None:
            next_tokens = redraw(
                self.sampler, b.logits, next_tokens, sp.redraw, sp.grammar_mask, procs=sp.procs, filtered=sp.filtered
            )
        elif sp.sampler_io is not None:  # redrawn over the processed and filtered logits (the same draw)
            # min-p alone runs in the processor variant (no sort), over idle processor rows
            next_tokens = self.graphs.resample(
                bs,
                sp.sampler_io,
                sp.grammar_rows,
                sp.grammar_mask,
                procs=sp.procs or sp.any_min_p,
                filtered=sp.filtered,
            )
        return b.logits[:n], next_tokens[:n]

    def _forward_eager(self, desc: BatchDesc, batch: ForwardBatch, s: StepInputs[torch.Tensor], counts: bool = False):
        """Runs the step eagerly: (logits, sampled tokens, prompt logprobs or None). `counts`: a verify
        step run as decode rows whose processors count the proposals before each sample."""
        tokens = self.table.flat_pool
        if desc.is_prefill:
            tokens.index_copy_(0, s.token_idx, batch.input_ids)
        if s.token_read is not None:
            batch.input_ids = tokens.index_select(0, s.token_read)
        if self.takes_hidden:  # where the head's hidden states come from
            last = batch.last_idx if desc.is_prefill else None
            hidden = self.model(batch.input_ids.long(), batch.positions, self.attn, s.hidden_loc, batch.slots, last)
        elif self.extend_graphs is not None and (tokens := self.extend_graphs.bucket(desc.num_tokens)):
            hidden = self.extend_graphs.run(tokens, batch.input_ids, batch.positions, batch.out_loc)
        else:
            hidden = self.model(batch.input_ids.long(), batch.positions, self.attn)
        self.inputs_free.record(self.stream)
        logits = self.model.compute_logits(hidden[batch.last_idx] if desc.is_prefill else hidden)
        sp = s.sampling
        verifies = desc.spec_lens is not None  # an extend step (not one run as decode rows)
        if not verifies:
            sample_pos, rows = batch.seq_lens, desc.batch_size
            if desc.sample_shift:
                sample_pos = sample_pos + desc.sample_shift
        else:
            sample_pos, rows = s.spec.sample_pos, len(s.spec.rows)
        args = sp.args(sample_pos, rows)
        if verifies or counts:
            args = _verify_args(args, s.spec)
        next_tokens = self.sampler(logits, args, procs=sp.procs, filtered=sp.filtered)
        scored = None
        if sp.plp_idx is not None:
            scored = prompt_logprobs(self.model.compute_logits, hidden, sp.plp_idx, sp.plp_target, desc.prompt_logprobs)
        return logits, next_tokens, scored

    def _to_host(self, next_tokens: torch.Tensor, logits: torch.Tensor, top_logprobs: int) -> StepOutput:
        out = StepOutput(next_tokens=self._host_copy(next_tokens), done=new_event(self.device))
        if top_logprobs >= 0:
            chosen, values, ids = token_logprobs(logits, next_tokens, top_logprobs)
            out.logprobs = self._host_copy(chosen)
            if values is not None:
                out.top_logprobs, out.top_ids = self._host_copy(values), self._host_copy(ids)
        return out

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        # the caching host allocator hands this block out again only once the copy is done
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host


def _verify_args(args: SampleArgs, spec: SpecRows) -> SampleArgs:
    """A verify step's sampler arguments: penalties count each sample's proposals before it, and only
    the kept samples after it."""
    args.proposed = (spec.proposed_at, spec.proposed_token)
    args.verify = (spec.drafts, spec.rows, spec.row_start)
    return args
