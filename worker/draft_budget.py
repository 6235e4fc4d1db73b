"""What a draft model (speculative decoding) takes of the device beside the model it proposes for: its
weights, and its KV cache's bytes a page (it holds as many pages as the model; an EAGLE-3 head, also the
model's hidden states it reads, projected to its width, one a token). The model's engine sizes
its own cache with both counted, so that the draft, built after it, finds its memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from worker.extend_graphs import extend_graph_bytes
from worker.kv_cache import KVCachePool
from worker.models.eagle3 import is_eagle3
from worker.models.llama import head_dim_of


@dataclass(frozen=True)
class DraftMemory:
    weight_bytes: int
    bytes_per_page: int
    graph_bytes: int = 0  # its extend graphs' activations (worker/extend_graphs.py), a full draft's alone


def draft_memory(
    folder: str, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, extend_graph_tokens: int = 0
) -> DraftMemory:
    """The draft in `folder` at the model's dtypes and page size: its parameters counted on the meta
    device (nothing is allocated), its KV bytes a page from its layers and heads, and (a full model
    capturing extend graphs of up to `extend_graph_tokens` tokens) what those graphs hold."""
    config = AutoConfig.from_pretrained(folder)
    if is_eagle3(config):  # one layer, and the projected hidden state it reads kept at every KV cell
        per_page = KVCachePool.bytes_per_page(1, page_size, config.num_key_value_heads, head_dim_of(config), kv_dtype)
        per_page += config.hidden_size * page_size * dtype.itemsize
        weights = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        return DraftMemory(weights, per_page)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    except Exception:  # noqa: BLE001 - a model transformers cannot build: its weights' files as stored
        weights = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    per_page = KVCachePool.bytes_per_page(text.num_hidden_layers, page_size, kv_heads, head_dim, kv_dtype)
    return DraftMemory(weights, per_page, extend_graph_bytes(text, extend_graph_tokens, dtype))
