"""Mixtral: the Mistral decoder with a sparse block on every layer (`block_sparse_moe`, experts w1/w3/w2),
its top-2 weights renormalised to sum to one."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from worker.kernels import Kernels
from worker.layers.moe import SparseMoeBlock
from worker.models.llama import LlamaForCausalLM
from worker.parallel import TPGroup


def mixtral_mlp(config: PretrainedConfig, layer_id: int, tp: TPGroup, kernels: Kernels) -> nn.Module:
    return SparseMoeBlock(
        config.hidden_size,
        config.intermediate_size,
        config.num_local_experts,
        config.num_experts_per_tok,
        True,
        tp,
        kernels,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_of = staticmethod(mixtral_mlp)
    packed = {
        **LlamaForCausalLM.packed,
        "block_sparse_moe": ("mlp", 0),
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
    }
