"""Rotary position embedding (neox style), with every scaling type that transformers knows (Llama-3's too)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.kernels import Kernels
from worker.layers.fused import fused_ops

_FUSED_HEAD_DIMS = (64, 128, 256)  # what FlashInfer's rotary kernel is built for


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, kernels: Kernels = Kernels()
    ) -> None:
        super().__init__()
        self.fused = kernels.fused and head_dim in _FUSED_HEAD_DIMS
        params = rope_parameters(config)
        if params["rope_type"] == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scale = 1.0
        elif params["rope_type"] in ROPE_INIT_FUNCTIONS and params["rope_type"] != "dynamic":
            inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
        else:
            raise ValueError(f"unsupported rope type {params['rope_type']!r}")
        positions = torch.arange(max_positions, dtype=torch.float)
        # transformers' initializers give CPU tensors; positions are on the device the model is built on
        freqs = positions.unsqueeze(1) * inv_freq.float().to(positions.device).unsqueeze(0)
        # cos and sin per position, precomputed once: a step only gathers rows
        self.register_buffer("cos_sin", torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (rotated in place on the fused path)."""
        ops = fused_ops(q) if self.fused else None
        if ops is not None:
            head_dim = q.shape[-1]
            ops.rope_inplace(positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), head_dim, self.cos_sin, True)
            return q, k
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
