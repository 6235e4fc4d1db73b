"""The Triton attention prologue (q/k RMSNorm, rotary, KV-cache write in one kernel) against the torch
layers it replaces; on the CPU it runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy
from transformers import Qwen3Config

from worker.kv_cache import KVCachePool
from worker.layers import prologue
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding

pytest.importorskip("triton")


@pytest.fixture
def prologue_on():
    prologue.enable(True)
    yield
    prologue.enable(False)


@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 16, True), (4, 2, 16, False), (2, 1, 128, True)])
def test_prologue_equals_norm_rotary_and_cache_write(prologue_on, heads, kv_heads, head_dim, qk_norm):
    torch.manual_seed(0)
    tokens, eps = 7, 1e-6
    config = Qwen3Config(head_dim=head_dim, rope_theta=10000.0, max_position_embeddings=64)
    rotary = RotaryEmbedding(config, head_dim, 64)
    q_norm, k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 5, 9, 1, 33, 63, 2])
    out_loc = torch.tensor([3, 0, 11, 7, 8, 1, 15])
    ref_kv, got_kv = (KVCachePool(1, 16, 1, kv_heads, head_dim, torch.float32, torch.device("cpu")) for _ in range(2))

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    ref_q, ref_k = rotary(positions, q, k)
    ref_kv.store(0, out_loc, ref_k, v.reshape(tokens, kv_heads, head_dim))

    assert prologue.applies(qkv, head_dim)
    got_q = prologue.qkv_prologue(qkv, positions, out_loc, rotary.cos_sin, q_norm.weight if qk_norm else None,
                                  k_norm.weight if qk_norm else None, eps, got_kv.k(0), got_kv.v(0), heads,
                                  kv_heads, head_dim)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.buffer, ref_kv.buffer, rtol=1e-5, atol=1e-5)


def test_prologue_declines_what_it_cannot_do(prologue_on):
    assert not prologue.applies(torch.zeros(2, 3 * 24), 24)  # head size not a power of two
    assert not prologue.applies(torch.zeros(2, 3 * 32)[:, :64], 16)  # a strided view
    prologue.enable(False)
    assert not prologue.applies(torch.zeros(2, 3 * 16), 16)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_with_the_prologue_equals_hf(model_paths, family):
    path = model_paths[family]
    with checked_llm(path, page_size=4, triton_prologue=True) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        got = [o.token_ids for o in llm.generate(prompts, greedy(6))]
    prologue.enable(False)
    assert got == hf_greedy(path, prompts, 6)
