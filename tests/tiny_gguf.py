"""Tiny GGUF files of a mixture of experts, written from a tiny Hugging Face checkpoint as llama.cpp's converter
lays one out: its metadata under the GGUF architecture's keys, a byte-level BPE tokenizer (tokens, merges and
the chat template), float32 tensors under llama.cpp's names, each layer's experts stacked in one tensor a
projection (`blk.{i}.ffn_gate_exps`, [experts, intermediate, hidden])."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from transformers import AutoConfig

ARCHITECTURES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}


def write_moe_gguf(src: Path, path: Path) -> Path:
    """The checkpoint in `src` (a Qwen3-MoE or Qwen2-MoE whose every layer is sparse) as a GGUF file at `path`."""
    config = AutoConfig.from_pretrained(src)
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _add_tokenizer(writer, src)
    for name, tensor in _gguf_tensors(load_file(str(src / "model.safetensors")), config).items():
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def _gguf_tensors(weights: dict, config) -> dict:
    """llama.cpp's names for the checkpoint's tensors, the experts of a layer stacked a projection."""
    import torch

    out = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
        "output.weight": weights.get("lm_head.weight", weights["model.embed_tokens.weight"]),
    }
    for i in range(config.num_hidden_layers):
        layer, blk = f"model.layers.{i}", f"blk.{i}"
        out[f"{blk}.attn_norm.weight"] = weights[f"{layer}.input_layernorm.weight"]
        out[f"{blk}.ffn_norm.weight"] = weights[f"{layer}.post_attention_layernorm.weight"]
        for ours, theirs in _ATTENTION.items():
            for kind in ("weight", "bias"):
                if f"{layer}.self_attn.{ours}.{kind}" in weights:
                    out[f"{blk}.{theirs}.{kind}"] = weights[f"{layer}.self_attn.{ours}.{kind}"]
        for norm in ("q_norm", "k_norm"):
            if f"{layer}.self_attn.{norm}.weight" in weights:
                out[f"{blk}.attn_{norm}.weight"] = weights[f"{layer}.self_attn.{norm}.weight"]
        out[f"{blk}.ffn_gate_inp.weight"] = weights[f"{layer}.mlp.gate.weight"]
        for part, theirs in (
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ):
            out[f"{blk}.{theirs}.weight"] = torch.stack(
                [weights[f"{layer}.mlp.experts.{e}.{part}.weight"] for e in range(config.num_experts)]
            )
        for ours, theirs in _SHARED.items():
            if f"{layer}.mlp.shared_expert.{ours}.weight" in weights:
                out[f"{blk}.{theirs}.weight"] = weights[f"{layer}.mlp.shared_expert.{ours}.weight"]
        if f"{layer}.mlp.shared_expert_gate.weight" in weights:
            out[f"{blk}.ffn_gate_inp_shexp.weight"] = weights[f"{layer}.mlp.shared_expert_gate.weight"].reshape(-1)
    return out
