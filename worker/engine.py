"""One rank's engine: holds the model, KV cache, token pool and page table, and executes batch
descriptions. It knows nothing of requests or scheduling; every rank applies the same description."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from worker.attention import create_backend
from worker.batch import BatchDesc, ForwardBatch, StepOutput
from worker.config import EngineConfig
from worker.kv_cache import KVCachePool
from worker.loader import CheckpointError, init_dummy_weights, load_weights
from worker.models import build_model
from worker.parallel import TPGroup
from worker.sampler import sample
from worker.stream import new_event, new_stream, use_stream
from worker.token_table import TokenTable

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
        self.num_pages = config.num_pages or self._pages_from_budget(attn0.num_kv_heads, attn0.head_dim)
        self.kv = KVCachePool(self.hf_config.num_hidden_layers, self.num_pages, self.page_size, attn0.num_kv_heads,
                              attn0.head_dim, self.dtype, self.device)
        self.table = TokenTable(config.max_running_reqs, self.max_seq_len, self.device)
        self.attn = create_backend(config.attention_backend, self.kv, self.table.page_table, attn0.num_heads)
        self.stream = new_stream(self.device)          # compute
        self.sched_stream = new_stream(self.device)    # metadata copies
        self._pinned = self.device.type == "cuda"

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

    # -- one step --------------------------------------------------------------------------------

    def to_device(self, desc: BatchDesc) -> ForwardBatch:
        ext = desc.extend_lens.astype(np.int64)
        ends = np.cumsum(ext)
        starts = ends - ext
        if desc.is_prefill:
            cached = desc.seq_lens.astype(np.int64) - ext
            positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(cached - starts, ext)
        else:
            positions = desc.seq_lens.astype(np.int64) - 1
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t.pin_memory().to(dev, non_blocking=True) if self._pinned else t

        slots = put(np.repeat(desc.table_idx.astype(np.int64), ext))
        pos = put(positions)
        out_loc = put(desc.out_loc.astype(np.int64))
        table_idx = put(desc.table_idx.astype(np.int64))
        tokens, pages = self.table.token_pool, self.table.page_table
        pages[slots, pos] = out_loc.to(pages.dtype)
        for slot, locs in desc.prefix_rows:
            pages[slot, : len(locs)] = put(locs).to(pages.dtype)
        if desc.is_prefill:
            input_ids = put(desc.input_ids)
            tokens[slots, pos] = input_ids.to(tokens.dtype)
        else:
            input_ids = tokens[slots, pos]
        return ForwardBatch(desc=desc, input_ids=input_ids, positions=pos, out_loc=out_loc, table_idx=table_idx,
                            seq_lens=put(desc.seq_lens.astype(np.int32)), last_idx=put(ends - 1))

    @torch.inference_mode()
    def forward(self, desc: BatchDesc) -> StepOutput:
        """Launches one step on the compute stream and returns at once; `StepOutput.done` marks when
        the sampled tokens have reached the host."""
        with use_stream(self.stream):
            self.stream.wait_stream(self.sched_stream)
            batch = self.to_device(desc)
            self.attn.prepare(batch)
            hidden = self.model(batch.input_ids.long(), batch.positions, self.attn)
            logits = self.model.compute_logits(hidden[batch.last_idx])
            next_tokens = self._sample(logits, batch)
            # the next step reads its input here, on the device: the host never has to know it first
            self.table.token_pool[batch.table_idx, batch.seq_lens.long()] = next_tokens.to(torch.int32)
            return self._to_host(next_tokens, logits, desc.top_logprobs)

    def _sample(self, logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        d = batch.desc
        all_greedy = bool((d.temperature <= 0).all())
        if all_greedy:
            return logits.argmax(dim=-1)
        put = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        any_filter = bool(((d.top_k > 0) | (d.top_p < 1)).any())
        return sample(logits, put(d.temperature), put(d.top_p), put(d.top_k), put(d.seeds),
                      batch.seq_lens.long(), all_greedy=False, any_filter=any_filter)

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
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
