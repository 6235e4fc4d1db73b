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
from worker.kernels import Kernels
from worker.kv_cache import KVCachePool
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.sampling.sampler import filter_logits, sample, sample_unfiltered

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from worker import triton_kernels  # noqa: E402

INTERPRETED = Kernels(interpret_on_cpu=True)  # the Triton kernels on CPU tensors too (conftest sets TRITON_INTERPRET)


@pytest.mark.parametrize("block_tokens", [None, 4, 16])  # a token a program; blocks, the last partly masked
@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 16, True), (4, 2, 16, False), (2, 1, 128, True)])
def test_prologue_equals_norm_rotary_and_cache_write(heads, kv_heads, head_dim, qk_norm, block_tokens):
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

    assert triton_ops.prologue_applies(INTERPRETED, qkv, head_dim)
    got_q = triton_ops.qkv_prologue(
        qkv,
        positions,
        out_loc,
        rotary.cos_sin,
        q_norm.weight if qk_norm else None,
        k_norm.weight if qk_norm else None,
        eps,
        got_kv.k(0),
        got_kv.v(0),
        heads,
        kv_heads,
        head_dim,
        block_tokens=block_tokens,
    )
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.buffer, ref_kv.buffer, rtol=1e-5, atol=1e-5)


def test_prologue_takes_blocks_of_tokens_only_past_a_decode_steps_few():
    assert triton_ops.prologue_tiles(1) == triton_ops.prologue_tiles(32) == (1, 1)
    assert triton_ops.prologue_tiles(8192)[0] > triton_ops.prologue_tiles(256)[0] > 1
    # the warm-up's sizes reach every tile, each at its first size
    starts = triton_ops.PROLOGUE_TILE_STARTS
    assert [triton_ops.prologue_tiles(n) for n in starts] == [tile for _, tile in triton_ops.PROLOGUE_TILES]
    assert all(triton_ops.prologue_tiles(n - 1) != triton_ops.prologue_tiles(n) for n in starts[1:])
    with pytest.raises(ValueError, match="power of two"):
        triton_ops.qkv_prologue(torch.zeros(3, 64), *[None] * 8, 2, 1, 16, block_tokens=3)


def test_prologue_declines_what_it_cannot_do():
    assert not triton_ops.prologue_applies(INTERPRETED, torch.zeros(2, 3 * 24), 24)  # head size not a power of two
    assert not triton_ops.prologue_applies(INTERPRETED, torch.zeros(2, 3 * 32)[:, :64], 16)  # a strided view
    assert triton_ops.prologue_applies(INTERPRETED, torch.zeros(2, 3 * 16), 16)
    assert not triton_ops.prologue_applies(Kernels(triton=False, interpret_on_cpu=True), torch.zeros(2, 3 * 16), 16)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_with_triton_kernels_equals_hf_greedy_and_samples_as_torch_does(model_paths, family):
    path = model_paths[family]
    seeded = [SamplingParams(temperature=0.8, max_tokens=12, seed=s, ignore_eos=True) for s in range(3)]
    with checked_llm(path, page_size=4, kernels=INTERPRETED) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        got = [o.token_ids for o in llm.generate(prompts, greedy(6))]
        sampled = [o.token_ids for o in llm.generate(prompts, seeded)]
        assert [o.token_ids for o in llm.generate(prompts, seeded)] == sampled  # seeded: reproducible
    with checked_llm(path, page_size=4, kernels=Kernels(triton=False, interpret_on_cpu=True)) as llm:
        torch_sampled = [o.token_ids for o in llm.generate(prompts, seeded)]
    assert got == hf_greedy(path, prompts, 6)
    assert sampled == torch_sampled


@pytest.mark.parametrize("vocab", [360, 10_000])  # one block; several, the last one partial
def test_sampling_kernel_picks_what_the_torch_sampler_picks(vocab):
    torch.manual_seed(1)
    rows = 64
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.rand(rows) * 1.5
    temperature[::7] = 0.0  # greedy rows beside sampled ones
    seeds, positions = torch.arange(rows) * 7919 + 3, torch.arange(rows) + 11
    pool = torch.full((rows * 2 + 1,), -1, dtype=torch.int32)
    write = torch.arange(rows) * 2 + 1
    got = triton_ops.sample_rows(logits, temperature, seeds, positions, token_pool=pool, token_write=write)
    want = sample_unfiltered(logits, temperature, seeds, positions)
    assert torch.equal(got[::7].long(), logits[::7].argmax(-1))
    assert (got.long() == want).float().mean() >= 0.98  # they may part only where rounding breaks a near-tie
    assert torch.equal(pool[write], got) and (pool[::2] == -1).all()


@triton.jit
def _near_one(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.75)
    tl.store(out_ptr + offs, -triton_kernels._ln_near_one(u - 1.0), mask=offs < n)


def test_the_samplers_logarithm_near_one_keeps_its_relative_precision():
    """On CUDA the sampler takes -ln u for uniforms above sqrt(1/2) from a polynomial in u - 1: there -ln u
    is tiny where the Gumbel noise is largest, and its relative error is the noise's absolute error. Over
    the top uniforms the sampler can draw and a spread below them, within 3 float32 ulps of float64's."""
    top = (2**24 - 1 - torch.arange(4096, dtype=torch.float64) + 0.5) / 2**24  # the sampler's largest uniforms
    spread = torch.linspace(0.70710677, 0.9997, 8192, dtype=torch.float64)
    u = torch.cat([top, spread]).float().clamp(max=1 - 2**-24)  # held below 1 as the sampler holds it
    out = torch.empty_like(u)
    _near_one[(-(-u.numel() // 1024),)](u, out, u.numel(), BLOCK=1024)
    want = -torch.log(u.double())
    assert ((out.double() - want).abs() / want).max() < 3 * 2**-24


@triton.jit
def _exact_log2(x):
    return tl.log2(x)


@triton.jit
def _noise(u_ptr, out_ptr, n, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(out_ptr + offs, triton_kernels._gumbel(u, FAST_LOG), mask=offs < n)


def test_the_samplers_noise_on_cuda_is_the_torch_samplers(monkeypatch):
    """The noise CUDA's sampler computes, its hardware log2 stood in for by the exact one (the interpreter
    has no hardware): within 2e-6 of the torch sampler's over the uniforms it draws, the top ones included."""
    import types

    monkeypatch.setattr(triton_kernels, "libdevice", types.SimpleNamespace(fast_log2f=_exact_log2))
    k = torch.cat(
        [
            torch.arange(2**24 - 4096, 2**24),
            torch.randint(0, 2**24, (16384,), generator=torch.Generator().manual_seed(0)),
        ]
    )
    u = ((k.double() + 0.5) / 2**24).float().clamp(max=1 - 2**-24)
    fast, precise = torch.empty_like(u), torch.empty_like(u)
    for out, mode in ((fast, True), (precise, False)):
        _noise[(-(-u.numel() // 1024),)](u, out, u.numel(), FAST_LOG=mode, BLOCK=1024)
    want = -torch.log(-torch.log(u.double()))
    assert (precise.double() - want).abs().max() < 2e-6
    assert (fast.double() - want).abs().max() < 2e-6


def test_sampling_kernel_reads_bfloat16_logits_and_int32_positions():
    torch.manual_seed(2)
    logits = (torch.randn(8, 3000) * 2).bfloat16()
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.5, 0.9, 1.0])
    seeds, positions = torch.arange(8) + (1 << 40), torch.arange(8, dtype=torch.int32) * 3
    got = triton_ops.sample_rows(logits, temperature, seeds, positions)
    want = sample_unfiltered(logits.float(), temperature, seeds, positions.long())
    assert (got.long() == want).float().mean() >= 0.85
    assert got[0] == logits[0].float().argmax() and got[3] == logits[3].float().argmax()


def test_gumbel_draws_follow_the_softmax():
    # one row drawn at 20,000 positions: each token's frequency is its probability under softmax(x / T)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n, temperature = 20_000, 0.8
    rows = logits.expand(n, -1)
    got = sample_unfiltered(rows, torch.full((n,), temperature), torch.full((n,), 42), torch.arange(n))
    freq = torch.bincount(got, minlength=6).double() / n
    probs = torch.softmax(logits[0].double() / temperature, dim=0)
    assert freq[4] == 0
    torch.testing.assert_close(freq, probs, atol=0.012, rtol=0)


def test_top_k_and_top_p_keep_what_they_promise_and_leave_other_rows_alone():
    torch.manual_seed(3)
    rows, vocab = 6, 500
    logits = torch.randn(rows, vocab) * 2
    temperature = torch.full((rows,), 0.9)
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0, 0.3])
    top_k = torch.tensor([-1, -1, 5, 40, 0, 1], dtype=torch.int32)
    masked = filter_logits(logits, temperature, top_p, top_k)
    kept = torch.isfinite(masked).sum(dim=1)
    assert kept[0] == vocab and kept[4] == vocab and torch.equal(masked[0], logits[0])
    assert kept[2] == 5 and kept[3] <= 40 and kept[5] == 1
    probs = torch.softmax(logits / 0.9, dim=-1)
    # top-p keeps the smallest set of most likely tokens whose mass reaches p
    for r, p in ((1, 0.5), (3, 0.9)):
        mass = probs[r].sort(descending=True).values[: int(kept[r])]
        assert mass[:-1].sum() < p
        if r == 1:
            assert mass.sum() >= p
    seeds, positions = torch.arange(rows), torch.full((rows,), 7)
    filtered = sample(logits, temperature, top_p, top_k, seeds, positions, any_filter=True)
    plain = sample(logits, temperature, top_p, top_k, seeds, positions, any_filter=False)
    assert filtered[0] == plain[0] and filtered[4] == plain[4]  # rows that filter nothing: the same draw
    assert torch.isfinite(masked.gather(1, filtered.unsqueeze(1))).all()
    assert filtered[5] == logits[5].argmax()


def test_on_the_cpu_an_engines_default_runs_no_interpreted_kernel():
    x, default = torch.zeros(2, 48), Kernels()
    assert not triton_ops.available(default, x) and not triton_ops.kernels_available(default, x)
    assert triton_ops.available(INTERPRETED, x) and triton_ops.kernels_available(INTERPRETED, x)
