"""The fused-kernel path of the layers (FlashInfer's kernels on CUDA), checked on the CPU: the kernels
are replaced by torch stand-ins with FlashInfer's documented semantics (in place where FlashInfer is),
so what is verified is how the layers call them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy


def _norm(x, w, eps):
    h = x.float()
    return (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))


def _fused_add_rmsnorm(x, residual, w, eps):
    residual.add_(x)
    x.copy_(_norm(residual, w, eps))


def _rope_inplace(positions, query, key, head_size, cos_sin, is_neox):
    assert is_neox and cos_sin.dtype == torch.float32
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    for t in (query, key):
        x = t.view(t.shape[0], -1, head_size)
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


STAND_INS = SimpleNamespace(
    rmsnorm=lambda x, w, eps: _norm(x, w, eps), fused_add_rmsnorm=_fused_add_rmsnorm, rope_inplace=_rope_inplace,
    silu_and_mul=lambda t: F.silu(t[..., : t.shape[-1] // 2]) * t[..., t.shape[-1] // 2:])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_layers_on_the_fused_path_match_hf(monkeypatch, model_paths, family):
    import worker.layers.mlp
    import worker.layers.norm
    import worker.layers.rotary
    for module in (worker.layers.norm, worker.layers.rotary, worker.layers.mlp):
        monkeypatch.setattr(module, "fused_ops", lambda x: STAND_INS)
    path = model_paths[family]
    with checked_llm(path) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        outs = llm.generate(prompts, greedy(10))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 10)
