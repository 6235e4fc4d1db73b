"""Tiny GGUF files written from a tiny Hugging Face checkpoint as llama.cpp's converter lays one out: its metadata
under the GGUF architecture's keys, a byte-level BPE tokenizer (tokens, merges and the chat template), tensors
under llama.cpp's names, a llama file's q and k rows in llama.cpp's rotary order (and llama 3's rotary scaling
as its `rope_freqs` tensor), a layer's experts stacked in one
tensor a projection (`blk.{i}.ffn_gate_exps`, [experts, intermediate, hidden]) or, as llama.cpp's older Mixtral
files keep them, a tensor an expert (`blk.{i}.ffn_gate.{e}`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

# a tiny checkpoint's family -> its GGUF architecture (llama.cpp writes Mixtral as llama with experts)
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",
}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}
# a projection's llama.cpp name, and its name in the checkpoint's mlp and in Mixtral's experts
_PROJECTIONS = (("ffn_gate", "gate_proj", "w1"), ("ffn_up", "up_proj", "w3"), ("ffn_down", "down_proj", "w2"))


def write_gguf_of(
    src: Path,
    path: Path,
    per_expert: bool = False,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    name: str | None = None,
    parts_of: int = 0,
) -> Path:
    """The checkpoint in `src` as a GGUF file at `path`. `per_expert`: a mixture's experts a tensor each (llama.cpp's
    older Mixtral files); `types`: the tensors stored in another type than float32 (F16, Q8_0, ...), by their GGUF
    name without the layer (`attn_q.weight`, `token_embd.weight`); `name`: the model's `general.name`; `parts_of`: split
    in files of that many tensors as llama.cpp's gguf-split writes them (PATH-00001-of-0000N.gguf, the first
    returned)."""
    config = AutoConfig.from_pretrained(src)
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=parts_of)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _add_tokenizer(writer, src)
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", rope_factors(config.rope_parameters, head_dim))
    for name, tensor in _gguf_tensors(load_file(str(src / "model.safetensors")), config, per_expert).items():
        values = np.ascontiguousarray(tensor.float().numpy())
        part = name.split(".", 2)[-1] if name.startswith("blk.") else name
        kind = (types or {}).get(part, gguf.GGMLQuantizationType.F32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))[0] if parts_of else path


def _add_tokenizer(writer: gguf.GGUFWriter, src: Path) -> None:
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    settings = json.loads((src / "tokenizer_config.json").read_text())
    eos = vocab[settings["eos_token"]]
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    template = settings.get("chat_template") or (src / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` of llama 3's rotary scaling: the factor it divides each frequency by."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's order of a head's q or k rows: each head's rotating halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_tensors(weights: dict, config, per_expert: bool) -> dict:
    """llama.cpp's names for the checkpoint's tensors."""
    out = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
    }
    if "lm_head.weight" in weights:
        out["output.weight"] = weights["lm_head.weight"]
    llama = ARCHITECTURES[config.model_type] == "llama"
    for i in range(config.num_hidden_layers):
        layer, blk = f"model.layers.{i}", f"blk.{i}"
        out[f"{blk}.attn_norm.weight"] = weights[f"{layer}.input_layernorm.weight"]
        out[f"{blk}.ffn_norm.weight"] = weights[f"{layer}.post_attention_layernorm.weight"]
        for ours, theirs in _ATTENTION.items():
            for kind in ("weight", "bias"):
                if f"{layer}.self_attn.{ours}.{kind}" in weights:
                    out[f"{blk}.{theirs}.{kind}"] = weights[f"{layer}.self_attn.{ours}.{kind}"]
        if llama:
            out[f"{blk}.attn_q.weight"] = permute(out[f"{blk}.attn_q.weight"], config.num_attention_heads)
            out[f"{blk}.attn_k.weight"] = permute(out[f"{blk}.attn_k.weight"], config.num_key_value_heads)
        for norm in ("q_norm", "k_norm"):
            if f"{layer}.self_attn.{norm}.weight" in weights:
                out[f"{blk}.attn_{norm}.weight"] = weights[f"{layer}.self_attn.{norm}.weight"]
        out.update(_mlp(weights, config, layer, blk, per_expert))
    return out


def _mlp(weights: dict, config, layer: str, blk: str, per_expert: bool) -> dict:
    out = {}
    mixtral = f"{layer}.block_sparse_moe.gate.weight" in weights
    mlp = f"{layer}.block_sparse_moe" if mixtral else f"{layer}.mlp"
    if f"{mlp}.gate.weight" not in weights:  # a dense layer
        for theirs, ours, _ in _PROJECTIONS:
            out[f"{blk}.{theirs}.weight"] = weights[f"{mlp}.{ours}.weight"]
        return out
    out[f"{blk}.ffn_gate_inp.weight"] = weights[f"{mlp}.gate.weight"]
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    for theirs, ours, w in _PROJECTIONS:
        parts = [weights[f"{mlp}.experts.{e}.{w if mixtral else ours}.weight"] for e in range(experts)]
        if per_expert:
            out.update({f"{blk}.{theirs}.{e}.weight": part for e, part in enumerate(parts)})
        else:
            out[f"{blk}.{theirs}_exps.weight"] = torch.stack(parts)
    for ours, theirs in _SHARED.items():
        if f"{mlp}.shared_expert.{ours}.weight" in weights:
            out[f"{blk}.{theirs}.weight"] = weights[f"{mlp}.shared_expert.{ours}.weight"]
    if f"{mlp}.shared_expert_gate.weight" in weights:
        out[f"{blk}.ffn_gate_inp_shexp.weight"] = weights[f"{mlp}.shared_expert_gate.weight"].reshape(-1)
    return out
