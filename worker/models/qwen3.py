"""Qwen3: the Llama decoder with RMSNorm on each query and key head, and an explicit head_dim."""

from worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
