"""Programmatic dependent launch (Kernels.pdl) on a GPU of compute capability 9.0+: a kernel launched with it
may start before the kernel it follows has finished, so a read before its wait would see a stale row. It
changes no arithmetic, so every result with it equals the result without it, bit for bit: a chain of
dependent batch-1 kernels replayed in a CUDA graph, and whole generations of a dense model, a mixture of
experts and FP8 weights at batch 1 through the engine's graphs. On the CPU, tests/test_kernel_compile.py
checks that each of these kernels touches no global memory before its wait."""

from __future__ import annotations

import pytest
import torch
from fixtures import PROMPT_TEXTS
from helpers import checked_llm, encode_all, greedy
from tiny_checkpoints import build_qwen3_hd128

from worker import gemv, triton_decode, triton_ops
from worker.kernels import Kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="programmatic dependent launch needs compute capability 9.0+",
    ),
]


@pytest.fixture(scope="module")
def hd128(tmp_path_factory: pytest.TempPathFactory):
    return build_qwen3_hd128(tmp_path_factory.mktemp("qwen3_hd128"))


def _layers(
    x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], pdl: bool, prefetch: int | None = None
) -> torch.Tensor:
    """Dependent launches as a batch-1 step makes them: each reads the rows the one before wrote."""
    residual = None
    for norm_w, w_gate_up, w_down, w_o in weights:
        gate_up, residual, _ = gemv.norm_linear(
            x, residual, norm_w, 1e-6, w_gate_up, pdl=pdl, prefetch_programs=prefetch
        )
        act = gemv.silu_linear(gate_up, w_down, pdl=pdl, prefetch_programs=prefetch)
        x = gemv.small_linear(act, w_o, pdl=pdl, prefetch_programs=prefetch)
    return x + residual


# the default rule, every program, and none prefetching its weights before the wait
@pytest.mark.parametrize("prefetch", [None, triton_ops.PDL_PREFETCH_ALL, 0])
def test_a_chain_of_pdl_launches_in_a_cuda_graph_equals_the_chain_without_pdl(prefetch):
    torch.manual_seed(0)
    dev, dt, k = "cuda", torch.bfloat16, 1024
    weights = [
        (
            torch.rand(k, device=dev, dtype=dt) + 0.5,
            torch.randn(2 * k, k, device=dev, dtype=dt) * 0.03,
            torch.randn(k, k, device=dev, dtype=dt) * 0.03,
            torch.randn(k, k, device=dev, dtype=dt) * 0.03,
        )
        for _ in range(12)
    ]
    static_x = torch.zeros(1, k, device=dev, dtype=dt)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _layers(static_x, weights, pdl=True, prefetch=prefetch)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = _layers(static_x, weights, pdl=True, prefetch=prefetch)
    for draw in range(20):
        x = torch.randn(1, k, device=dev, dtype=dt)
        want = _layers(x, weights, pdl=False)
        eager = _layers(x, weights, pdl=True, prefetch=prefetch)
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, want), draw
        assert torch.equal(eager, want), draw


def test_batch_1_decode_attention_with_pdl_reads_the_key_the_prologue_wrote():
    """The prologue writes the step's key and value into the cache and the decode kernel, launched while
    the prologue may still run, attends over them: a read before its wait misses the newest token."""
    torch.manual_seed(1)
    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads, head_dim, page, pages, tokens = 16, 8, 128, 16, 64, 700
    k_cache = torch.randn(pages * page, kv_heads, head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    cos_sin = torch.randn(4096, head_dim, device=dev, dtype=torch.float32)
    norm_w = torch.rand(head_dim, device=dev, dtype=dt) + 0.5
    indptr = torch.tensor([0, -(-tokens // page)], dtype=torch.int32, device=dev)
    indices = torch.arange(pages, dtype=torch.int32, device=dev)
    last = torch.tensor([(tokens - 1) % page + 1], dtype=torch.int32, device=dev)
    splits = triton_decode.decode_num_splits(1, kv_heads)
    scratch = triton_decode.decode_scratch(1, heads, head_dim, splits, dev)
    pos = torch.tensor([tokens - 1], device=dev)

    def step(qkv: torch.Tensor, pdl: bool) -> torch.Tensor:
        q = triton_ops.qkv_prologue(
            qkv, pos, pos, cos_sin, norm_w, norm_w, 1e-6, k_cache, v_cache, heads, kv_heads, head_dim, pdl=pdl
        )
        paged = (k_cache.view(pages, page, kv_heads, head_dim), v_cache.view(pages, page, kv_heads, head_dim))
        return triton_decode.paged_decode(
            q, *paged, indptr, indices, last, num_splits=splits, scratch=scratch, pdl=pdl
        ).clone()

    width = (heads + 2 * kv_heads) * head_dim
    for draw in range(10):
        qkv = torch.randn(1, width, device=dev, dtype=dt)
        want = step(qkv, pdl=False)
        k_cache[tokens - 1].normal_()  # the row the prologue writes again
        assert torch.equal(step(qkv, pdl=True), want), draw


def _generate(path, kernels: Kernels, **kw) -> list[list[int]]:
    """Each prompt alone (every decode step one row, from the engine's CUDA graphs), greedy."""
    with checked_llm(path, kernels=kernels, num_pages=4096, page_size=16, max_running_reqs=4, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:4])
        return [llm.generate([p], greedy(40, ignore_eos=True))[0].token_ids for p in prompts]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_batch_1_generation_with_pdl_equals_generation_without_it(hd128, quantization):
    kw = {"dtype": "bfloat16", "quantization": quantization}
    assert _generate(hd128, Kernels(pdl="on"), **kw) == _generate(hd128, Kernels(pdl="off"), **kw)


def test_batch_1_generation_of_a_mixture_with_pdl_equals_generation_without_it(qwen3_moe_path):
    """The router's norm-GEMV and the per-row expert kernels (its head size has no FlashInfer kernels:
    torch attention)."""
    kw = {"dtype": "bfloat16"}
    with_pdl = _generate(qwen3_moe_path, Kernels(attention="torch", pdl="on"), **kw)
    assert with_pdl == _generate(qwen3_moe_path, Kernels(attention="torch", pdl="off"), **kw)
