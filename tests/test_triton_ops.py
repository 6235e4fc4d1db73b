"""The Triton kernels (attention prologue: q/k RMSNorm, rotary and the KV-cache write in one kernel;
sampling with temperature in one kernel) against the torch code they replace; on the CPU they run
under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy
from transformers import Qwen3Config

from cluster import SamplingParams
from worker import triton_ops
from worker.kv_cache import KVCachePool
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.sampler import sample, uniform_from

pytest.importorskip("triton")


@pytest.fixture
def triton_on():
    triton_ops.enable(True)
    yield
    triton_ops.enable(False)


@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 16, True), (4, 2, 16, False), (2, 1, 128, True)])
def test_prologue_equals_norm_rotary_and_cache_write(triton_on, heads, kv_heads, head_dim, qk_norm):
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

    assert triton_ops.prologue_applies(qkv, head_dim)
    got_q = triton_ops.qkv_prologue(qkv, positions, out_loc, rotary.cos_sin, q_norm.weight if qk_norm else None,
                                  k_norm.weight if qk_norm else None, eps, got_kv.k(0), got_kv.v(0), heads,
                                  kv_heads, head_dim)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.buffer, ref_kv.buffer, rtol=1e-5, atol=1e-5)


def test_prologue_declines_what_it_cannot_do(triton_on):
    assert not triton_ops.prologue_applies(torch.zeros(2, 3 * 24), 24)  # head size not a power of two
    assert not triton_ops.prologue_applies(torch.zeros(2, 3 * 32)[:, :64], 16)  # a strided view
    triton_ops.enable(False)
    assert not triton_ops.prologue_applies(torch.zeros(2, 3 * 16), 16)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_with_triton_kernels_equals_hf_greedy_and_samples_as_torch_does(model_paths, family):
    path = model_paths[family]
    seeded = [SamplingParams(temperature=0.8, max_tokens=12, seed=s, ignore_eos=True) for s in range(3)]
    with checked_llm(path, page_size=4, triton_kernels=True) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        got = [o.token_ids for o in llm.generate(prompts, greedy(6))]
        sampled = [o.token_ids for o in llm.generate(prompts, seeded)]
        assert [o.token_ids for o in llm.generate(prompts, seeded)] == sampled  # seeded: reproducible
    with checked_llm(path, page_size=4) as llm:
        torch_sampled = [o.token_ids for o in llm.generate(prompts, seeded)]
    triton_ops.enable(False)
    assert got == hf_greedy(path, prompts, 6)
    assert sampled == torch_sampled


@pytest.mark.parametrize("vocab", [360, 10_000])  # one block; several, the last one partial
def test_sampling_kernel_picks_what_the_torch_sampler_picks(triton_on, vocab):
    torch.manual_seed(1)
    rows = 64
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.rand(rows) * 1.5
    temperature[::7] = 0.0  # greedy rows beside sampled ones
    seeds, positions = torch.arange(rows) * 7919 + 3, torch.arange(rows) + 11
    got = triton_ops.sample_rows(logits, temperature, uniform_from(seeds, positions))
    triton_ops.enable(False)
    want = sample(logits, temperature, torch.ones(rows), torch.full((rows,), -1), seeds, positions,
                  all_greedy=False, any_filter=False)
    assert torch.equal(got[::7], logits[::7].argmax(-1))
    assert (got == want).float().mean() >= 0.95  # they may part only where u is within rounding of a step
    assert ((got >= 0) & (got < vocab)).all()


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_a_draw_at_the_top_of_the_cdf_lands_on_a_token_with_probability(monkeypatch, use_triton):
    import worker.sampler as sampler
    vocab = 5000
    logits = torch.zeros(2, vocab)
    logits[:, 4000:] = -1e4  # a tail of tokens with no probability (exp underflows to 0)
    near_one = torch.tensor([1 - 1e-12, 1 - 1e-9], dtype=torch.float64)
    monkeypatch.setattr(sampler, "uniform_from", lambda seeds, positions: near_one)
    triton_ops.enable(use_triton)
    try:
        got = sample(logits, torch.ones(2), torch.ones(2), torch.full((2,), -1), torch.zeros(2, dtype=torch.int64),
                     torch.zeros(2, dtype=torch.int64), all_greedy=False, any_filter=False)
    finally:
        triton_ops.enable(False)
    assert (got < 4000).all() and (got >= 3990).all(), got
