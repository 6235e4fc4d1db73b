"""Qwen3-MoE (the Qwen3 decoder, q/k norm) and Qwen2-MoE (the Qwen2 decoder, qkv bias, plus a shared
expert behind a sigmoid gate): sparse blocks on every `decoder_sparse_step`-th layer not in
`mlp_only_layers`, dense SwiGLU on the others."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from worker.kernels import Kernels
from worker.layers.moe import SparseMoeBlock
from worker.models.llama import LlamaForCausalLM, dense_mlp
from worker.parallel import TPGroup


def is_sparse(config: PretrainedConfig, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return config.num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


def qwen_moe_mlp(config: PretrainedConfig, layer_id: int, tp: TPGroup, kernels: Kernels) -> nn.Module:
    if not is_sparse(config, layer_id):
        return dense_mlp(config, layer_id, tp, kernels)
    return SparseMoeBlock(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        bool(getattr(config, "norm_topk_prob", False)),
        tp,
        kernels,
        shared_intermediate=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    mlp_of = staticmethod(qwen_moe_mlp)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    mlp_of = staticmethod(qwen_moe_mlp)

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup, kernels: Kernels = Kernels()) -> None:
        super().__init__(config, max_positions, tp, kernels)
        if not getattr(config, "shared_expert_intermediate_size", 0):
            # transformers saves a shared expert of width 0 (its weights empty, its output zeros) and its gate
            # all the same; the sparse blocks have none (SparseMoeBlock), so the loader passes over them
            self.ignored = tuple(
                f"model.layers.{i}.mlp.{name}.weight"
                for i in range(config.num_hidden_layers)
                if is_sparse(config, i)
                for name in (*(f"shared_expert.{p}_proj" for p in ("gate", "up", "down")), "shared_expert_gate")
            )
