"""cuBLASLt's products at a timed algorithm (worker/cublaslt.py) on the GPU: every algorithm the heuristic
lists computes x @ w.T as F.linear does, within half precision's rounding; a product captured in a CUDA
graph replays what it computes eagerly; the registry hands out exactly the products that beat F.linear;
and an engine whose every graph product runs a tuned algorithm generates as one on cuBLAS's picks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import greedy
from test_gpu import KV_TOKENS, agreement, run
from tiny_checkpoints import build_qwen3_hd128, random_prompts

from cluster import SamplingParams
from worker import cublaslt
from worker.kernels import Kernels

pytestmark = pytest.mark.gpu

# (m, n, k): a decode batch over Qwen3-0.6B's qkv, a few rows over its down, a batch over an odd width
SHAPES = [(256, 4096, 1024), (16, 1024, 3072), (48, 6144, 1024), (8, 320, 64)]


@pytest.fixture(autouse=True)
def fresh_registry(tmp_path, monkeypatch):
    """No product tuned, and timings kept in a file of the test's own."""
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    cublaslt.forget()
    yield
    cublaslt.forget()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_listed_algorithm_computes_the_product(m, n, k, dtype):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.05
    ref = x.float() @ w.float().T
    lt = cublaslt.LtLinear(m, n, k, dtype, x.device)
    assert lt.candidates, "the heuristic listed no algorithm"
    scale = ref.abs().max()
    for i, cand in enumerate(lt.candidates):
        got = lt.run(x, w, choice=cand).float()
        # each output a float32 sum rounded once to half precision (2^-8 relative for bf16), whatever the
        # algorithm's order of summation or split of K
        assert (got - ref).abs().max() <= 8e-3 * scale, f"candidate {i}: {lt.info(i)}"
    torch.testing.assert_close(lt.run(x, w).float(), F.linear(x, w).float(), atol=8e-3 * scale.item(), rtol=0)


def test_a_product_in_a_cuda_graph_replays_its_eager_result():
    m, n, k = 64, 2048, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
    lt = cublaslt.LtLinear(m, n, k, torch.bfloat16, x.device)
    timings = lt.tune(x, weights)
    assert len(timings) == len(lt.candidates) and all(t > 0 for t in timings)
    assert lt.best_us == min(timings) and lt.baseline_us > 0
    eager = lt.run(x, weights[0]).clone()
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        lt.run(x, weights[0], out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_only_the_products_that_beat_f_linear_are_handed_out():
    shapes, rows = {(1024, 1024), (3072, 1024)}, [8, 64]
    results = cublaslt.tune_products(shapes, rows, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    assert {(r.m, r.n, r.k) for r in results} == {(m, n, k) for n, k in shapes for m in rows}
    for r in results:
        assert r.chosen == (r.best_us <= r.baseline_us * (1 - cublaslt.MIN_GAIN))
        x = torch.empty(r.m, r.k, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(r.n, r.k, device="cuda", dtype=torch.bfloat16)
        assert (cublaslt.tuned(x, w) is not None) == r.chosen
    assert not any(r.cached for r in results)
    # a second start times nothing: it reads the first one's timings and picks the same algorithms
    picked = {key: lt.algo.data[:] for key, lt in cublaslt._TUNED.items()}
    cublaslt.forget()
    again = cublaslt.tune_products(shapes, rows, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    assert all(r.cached for r in again) and again == [replace(r, cached=True) for r in results]
    assert {key: lt.algo.data[:] for key, lt in cublaslt._TUNED.items()} == picked


def test_an_engine_on_tuned_products_generates_as_one_on_cublas(tmp_path, monkeypatch):
    path = build_qwen3_hd128(tmp_path / "qwen3_hd128")
    prompts = random_prompts(16, 5, 120, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
    common = dict(dtype="bfloat16", page_size=16, cuda_graph_max_bs=16, num_pages=KV_TOKENS // 16)
    ref, ref_tops = run(path, prompts, params, kernels=Kernels(tuned_gemms=False), **common)
    monkeypatch.setattr(cublaslt, "MIN_GAIN", -1e9)  # every product on its fastest listed algorithm
    got, _ = run(path, prompts, params, **common)
    # every graph batch size but one row (the GEMV's: 2, 4, 8 and 16) of the model's two linear shapes (qkv's
    # and gate-up's 1,024 x 256, o's and down's 256 x 512)
    assert sorted({key[:3] for key in cublaslt._TUNED}) == [
        (m, n, k) for m in (2, 4, 8, 16) for n, k in ((256, 512), (1024, 256))
    ]
    assert agreement(ref, got, ref_tops) >= 0.99
    # and greedy through eager prompt steps and graph decode steps alike, no request failing
    again, _ = run(path, prompts[:4], greedy(8, ignore_eos=True), **common)
    assert all(len(t) == 8 for t in again)
