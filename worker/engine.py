"""One rank's engine: holds the model, KV cache, token pool and page table, and executes batch
descriptions. It knows nothing of requests or scheduling; every rank applies the same description.

A step runs on two CUDA streams. The scheduler stream copies the step's metadata to the device (one
copy from pinned staging), writes the page table and plans attention; it first waits for the previous
step's forward (`inputs_free`), which is the last reader of what it rewrites, so it overlaps that
step's LM head and sampling. The compute stream waits for it, runs the forward (a CUDA graph for
decode), samples, writes the sampled tokens into the token pool and copies them to the host. Nothing
here synchronizes the device; the host waits only on `StepOutput.done`."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from worker import triton_ops
from worker.attention import create_backend
from worker.batch import BatchDesc, ForwardBatch, StepOutput
from worker.config import EngineConfig
from worker.kv_cache import KVCachePool
from worker.layers import fused
from worker.loader import CheckpointError, init_dummy_weights, load_weights
from worker.models import build_model
from worker.parallel import TPGroup
from worker.sampler import sample
from worker.staging import PinnedStaging, Staged
from worker.stream import new_event, new_stream, use_stream
from worker.token_table import TokenTable

if TYPE_CHECKING:
    from worker.cuda_graph import CudaGraphRunner

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def load_hf_config(model_path: str) -> PretrainedConfig:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no config.json in {path}: give a local Hugging Face model folder")
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


class Engine:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        fused.enable(config.fused_kernels)
        triton_ops.enable(config.triton_kernels)
        self.hf_config = load_hf_config(config.model_path)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.max_seq_len = config.max_seq_len or self.hf_config.max_position_embeddings
        self.page_size = config.page_size
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = build_model(self.hf_config, self.max_seq_len + 1, self.tp)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        elif config.load_format == "auto":
            load_weights(self.model, Path(config.model_path), progress=self.tp.rank == 0)
        else:
            raise ValueError(f"unknown load_format {config.load_format!r}; choose auto or dummy")
        self.model.eval()
        attn0 = self.model.model.layers[0].self_attn
        # every rank must hold the pages rank 0 hands out; free memory can differ a little per GPU
        self.num_pages = config.num_pages or self.tp.comm.min_over_ranks(
            self._pages_from_budget(attn0.num_kv_heads, attn0.head_dim))
        # one page more than the scheduler hands out: the scratch page that padded graph rows write to
        self.scratch_page = self.num_pages
        self.kv = KVCachePool(self.hf_config.num_hidden_layers, self.num_pages + 1, self.page_size,
                              attn0.num_kv_heads, attn0.head_dim, self.dtype, self.device)
        self.table = TokenTable(config.max_running_reqs, self.max_seq_len, self.device)
        backend = config.attention_backend
        if backend == "auto" and self.dtype == torch.float32:
            backend = "torch"  # FlashInfer has no float32 kernels
        self.attn = create_backend(backend, self.kv, self.table.page_table, attn0.num_heads)
        self.stream = new_stream(self.device)          # compute
        self.sched_stream = new_stream(self.device)    # metadata copies and attention planning
        self.inputs_free = new_event(self.device)      # the last step's forward no longer reads its inputs
        self.staging = PinnedStaging(self.device)
        self.step_timer = None  # optional: an object with begin(stream, desc) and end(stream), for benchmarks
        self.graphs = self._capture_graphs()
        self._warm_up()

    def _warm_up(self) -> None:
        """One sampled prefill step of one token into the scratch page, on every rank alike (its
        collectives too): what the first request would otherwise wait for (FlashInfer's prefill
        kernels, Triton kernels: compiled on first use, a minute on a fresh host) happens here, before
        the replica takes traffic and before rank 0's watchdog times steps."""
        def one(value, dtype):
            return np.array([value], dtype=dtype)
        desc = BatchDesc(True, table_idx=one(0, np.int32), seq_lens=one(1, np.int32), extend_lens=one(1, np.int32),
                         out_loc=one(self.scratch_page * self.page_size, np.int32), input_ids=one(0, np.int32),
                         temperature=one(0.5, np.float32), top_p=one(1.0, np.float32), top_k=one(-1, np.int32),
                         seeds=one(0, np.int64))
        self.forward(desc).done.synchronize()

    def _pages_from_budget(self, kv_heads: int, head_dim: int) -> int:
        per_page = KVCachePool.bytes_per_page(self.hf_config.num_hidden_layers, self.page_size, kv_heads, head_dim,
                                              self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.cpu_kv_cache_gb * 2**30
        # there is no use for more pages than every slot filled to the context length
        most = self.config.max_running_reqs * -(-self.max_seq_len // self.page_size)
        pages = min(int(budget // per_page), most)
        if pages < 1:
            raise MemoryError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB budget, "
                              f"{per_page} bytes a page); lower max_running_reqs or raise the memory budget")
        return pages

    def _capture_graphs(self) -> CudaGraphRunner | None:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_reqs)
        if self.device.type != "cuda" or max_bs <= 0:
            return None
        from worker.attention.flashinfer_backend import FlashInferBackend
        if not isinstance(self.attn, FlashInferBackend):
            return None  # the torch backend's shapes change with every step's lengths
        from worker.cuda_graph import CudaGraphRunner
        graphs = CudaGraphRunner(self.model, self.attn, max_bs, self.scratch_page, self.device)
        with torch.inference_mode():
            graphs.capture(self.stream, progress=self.tp.rank == 0)
        return graphs

    # -- one step --------------------------------------------------------------------------------

    def _stage(self, desc: BatchDesc, bs: int) -> Staged:
        """Packs every array the step needs into pinned staging and copies it to the device (on the
        current stream). `bs` > 0 pads the decode rows to that CUDA-graph batch size."""
        slots = desc.table_idx.astype(np.int64)
        seq = desc.seq_lens.astype(np.int64)
        ext = desc.extend_lens.astype(np.int64)
        ends = np.cumsum(ext)
        pool_row = self.table.token_pool.shape[1]
        if desc.is_prefill:
            positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(seq - ends, ext)
            token_slots = np.repeat(slots, ext)
        else:
            positions, token_slots = seq - 1, slots
        a = {
            "table_idx": slots,
            "seq_lens": desc.seq_lens.astype(np.int32),
            "page_idx": token_slots * self.max_seq_len + positions,  # page-table cells this step fills
            "page_val": desc.out_loc.astype(np.int32),
            "token_write": slots * pool_row + seq,  # where each sampled token goes
            "last_idx": ends - 1,
        }
        if desc.is_prefill:
            a["input_ids"] = desc.input_ids.astype(np.int32)
            a["token_idx"] = token_slots * pool_row + positions
        else:
            pad = max(bs - desc.batch_size, 0)
            a["token_read"] = np.pad(slots * pool_row + seq - 1, (0, pad))
            positions = np.pad(positions, (0, pad))
        a["positions"] = positions
        a["out_loc"] = np.pad(desc.out_loc.astype(np.int64), (0, len(positions) - desc.num_tokens),
                              constant_values=self.scratch_page * self.page_size)
        if desc.prefix_rows:
            a["prefix_idx"] = np.concatenate([slot * self.max_seq_len + np.arange(len(locs)) for slot, locs in desc.prefix_rows])
            a["prefix_val"] = np.concatenate([locs for _, locs in desc.prefix_rows]).astype(np.int32)
        if not (desc.temperature <= 0).all():
            a.update(temperature=desc.temperature, top_p=desc.top_p, top_k=desc.top_k, seeds=desc.seeds)
        return self.staging.upload(a)

    @torch.inference_mode()
    def forward(self, desc: BatchDesc) -> StepOutput:
        """Launches one step and returns at once; `StepOutput.done` marks when the sampled tokens have
        reached the host."""
        bs = self.graphs.bucket(desc) if self.graphs is not None else 0
        n, pages = desc.num_tokens, self.table.page_table.view(-1)
        with use_stream(self.sched_stream):
            self.sched_stream.wait_event(self.inputs_free)
            staged = self._stage(desc, bs)
            d = staged.device
            pages.index_copy_(0, d["page_idx"], d["page_val"])
            if "prefix_idx" in d:
                pages.index_copy_(0, d["prefix_idx"], d["prefix_val"])
            # a decode step's input_ids are read from the token pool on the compute stream, below
            batch = ForwardBatch(desc=desc, input_ids=d.get("input_ids"), positions=d["positions"][:n],
                                 out_loc=d["out_loc"][:n], table_idx=d["table_idx"], seq_lens=d["seq_lens"],
                                 last_idx=d["last_idx"])
            if bs:
                self.graphs.prepare(desc, bs, d["positions"], d["out_loc"])
            else:
                self.attn.prepare(batch)
        with use_stream(self.stream):
            self.stream.wait_stream(self.sched_stream)
            if self.step_timer is not None:
                self.step_timer.begin(self.stream, desc)
            tokens = self.table.token_pool.view(-1)
            if desc.is_prefill:
                tokens.index_copy_(0, d["token_idx"], batch.input_ids)
            if bs:
                hidden = self.graphs.replay(bs, self.table.token_pool, d["token_read"], desc.batch_size)
            else:
                if not desc.is_prefill:
                    batch.input_ids = tokens.index_select(0, d["token_read"])
                hidden = self.model(batch.input_ids.long(), batch.positions, self.attn)
            self.inputs_free.record(self.stream)
            logits = self.model.compute_logits(hidden[batch.last_idx] if desc.is_prefill else hidden)
            next_tokens = self._sample(logits, batch, d)
            # the next step reads its input here, on the device: the host never has to know it first
            tokens.index_copy_(0, d["token_write"], next_tokens.to(torch.int32))
            out = self._to_host(next_tokens, logits, desc.top_logprobs)
            staged.release(self.stream)
            if self.step_timer is not None:
                self.step_timer.end(self.stream)
            return out

    def _sample(self, logits: torch.Tensor, batch: ForwardBatch, d: dict[str, torch.Tensor]) -> torch.Tensor:
        if "temperature" not in d:
            return logits.argmax(dim=-1)
        desc = batch.desc
        any_filter = bool(((desc.top_k > 0) | (desc.top_p < 1)).any())
        return sample(logits, d["temperature"], d["top_p"], d["top_k"], d["seeds"], batch.seq_lens.long(),
                      all_greedy=False, any_filter=any_filter)

    def _to_host(self, next_tokens: torch.Tensor, logits: torch.Tensor, top_logprobs: int) -> StepOutput:
        out = StepOutput(next_tokens=self._host_copy(next_tokens.to(torch.int32)), done=new_event(self.device))
        if top_logprobs >= 0:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprobs = self._host_copy(logp.gather(1, next_tokens.long().unsqueeze(1)).squeeze(1))
            if top_logprobs > 0:
                values, ids = logp.topk(top_logprobs, dim=-1)
                out.top_logprobs, out.top_ids = self._host_copy(values), self._host_copy(ids.to(torch.int32))
        out.done.record()
        return out

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        # the caching host allocator hands this block out again only once the copy is done
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
