"""Mixture-of-experts blocks: a replicated router picks each token's top-k experts, every expert's
weights are sharded across the tensor-parallel ranks on the intermediate dimension, and one all-reduce
follows the block as it follows a dense MLP. The experts run as a torch loop (the reference, everywhere)
or as fused Triton kernels (CUDA, CUDA-graph safe); Kernels.moe chooses."""

from worker.layers.moe.block import SparseMoeBlock
from worker.layers.moe.routing import select_experts

__all__ = ["SparseMoeBlock", "select_experts"]
