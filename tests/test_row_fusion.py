"""Batch-1 decode's fused launches (worker/layers/row_fusion.py): a residual norm inside the GEMV after it,
SiLU-and-multiply inside the down projection's. Against the torch norm, SiLU and matmul in float32 under
Triton's interpreter, and end to end against transformers' greedy output one prompt at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy

from worker import gemv
from worker.kernels import Kernels
from worker.layers.linear import ColumnParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.row_fusion import NORM_MAX_K, SILU_MAX_K, norm_linear, silu_linear
from worker.parallel import TPGroup

pytest.importorskip("triton")

INTERPRETED = Kernels(interpret_on_cpu=True)  # conftest sets TRITON_INTERPRET without a GPU


def _norm(dim: int, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(dim, eps)
    norm.weight.data.uniform_(0.5, 1.5)
    return norm


# K past one BLOCK_K (1,024) and not a multiple of it; N past one program's columns and not a multiple
@pytest.mark.parametrize("k,n", [(64, 48), (1100, 37), (96, 2500), (200, 5000)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("one_block", [False, True])
def test_norm_linear_equals_the_norm_then_the_matmul(k, n, with_residual, one_block):
    torch.manual_seed(k + n)
    x, residual = torch.randn(1, k), torch.randn(1, k) if with_residual else None
    weight, norm = torch.randn(n, k), _norm(k)
    ref_residual = x + residual if with_residual else x
    ref_normed = norm(ref_residual)
    assert gemv.row_fusion_applies(INTERPRETED, x, weight)
    y, new_residual, normed = gemv.norm_linear(
        x, residual, norm.weight, norm.eps, weight, write_normed=True, one_block=one_block
    )
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, ref_normed @ weight.T, rtol=1e-5, atol=1e-4)
    if with_residual:  # the inputs are left as they were: other programs read them while program 0 writes
        assert new_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())


@pytest.mark.parametrize("k,n", [(64, 48), (1100, 37), (96, 2500)])
def test_silu_linear_equals_silu_and_multiply_then_the_matmul(k, n):
    torch.manual_seed(k * n)
    gate_up, weight = torch.randn(1, 2 * k), torch.randn(n, k)
    gate, up = gate_up.chunk(2, dim=-1)
    got = gemv.silu_linear(gate_up, weight)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ weight.T, rtol=1e-5, atol=1e-4)


def test_the_layers_fuse_only_one_unquantized_narrow_row_with_both_kernels_asked_for():
    tp = TPGroup(0, 1)
    layer = ColumnParallelLinear(32, [16, 16], bias=True, tp=tp, kernels=INTERPRETED)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    norm, x, residual = _norm(32), torch.randn(1, 32), torch.randn(1, 32)
    calls = []
    real = gemv.norm_linear

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    gemv.norm_linear = counted
    try:
        y, new_residual, _ = norm_linear(norm, layer, x, residual, INTERPRETED)
        torch.testing.assert_close(y, norm(x + residual) @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_residual, x + residual)
        assert calls == [1]
        for rows, kernels in [(2, INTERPRETED), (1, Kernels(interpret_on_cpu=True, fused=False))]:
            norm_linear(norm, layer, torch.randn(rows, 32), torch.randn(rows, 32), kernels)
        norm_linear(norm, layer, x, residual, Kernels(interpret_on_cpu=True, small_linear=False))
        norm_linear(norm, layer, x, residual, Kernels())  # the CPU without the interpreter
        wide = ColumnParallelLinear(NORM_MAX_K + 1, [8], bias=False, tp=tp, kernels=INTERPRETED)
        norm_linear(_norm(NORM_MAX_K + 1), wide, torch.randn(1, NORM_MAX_K + 1), None, INTERPRETED)  # too wide to pay
        down = ColumnParallelLinear(SILU_MAX_K + 1, [8], bias=False, tp=tp, kernels=INTERPRETED)
        assert silu_linear(down, torch.randn(1, 2 * SILU_MAX_K + 2), INTERPRETED) is None
        layer.quant = object()  # a quantized layer multiplies through its method
        assert silu_linear(layer, torch.randn(1, 32), INTERPRETED) is None
        assert calls == [1]
    finally:
        gemv.norm_linear = real


# qwen2: a bias on qkv after the fused norm; qwen2_moe: the router's GEMV with the norm, the experts and
# the shared expert reading the normed row it writes, and dense SwiGLU blocks (the interpreter is slow:
# the other families run the same layers)
@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_batch_1_decode_with_the_fused_launches_equals_hf_greedy(model_paths, family, monkeypatch):
    """One prompt at a time every decode step is one row: each layer's norms run inside the GEMVs (qkv
    with its bias on qwen2; the router's, writing the normed row for the experts and the shared expert, on
    the mixtures), SiLU inside down on the dense blocks."""
    path = model_paths[family]
    launches = {"norm": 0, "silu": 0}
    for name, key in (("norm_linear", "norm"), ("silu_linear", "silu")):
        real = getattr(gemv, name)

        def counted(*args, _real=real, _key=key, **kw):
            launches[_key] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(gemv, name, counted)
    with checked_llm(path, page_size=4, kernels=INTERPRETED) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:2])
        got = [llm.generate([p], greedy(5))[0].token_ids for p in prompts]
    assert got == hf_greedy(path, prompts, 5)
    assert launches["norm"] > 0 and launches["silu"] > 0  # the mixtures' dense layers and shared expert: SiLU


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 128), (4096, 24576)])
def test_on_gpu_the_fused_launches_equal_flashinfers_norm_and_silu_then_the_gemv(k, n):
    """In bfloat16 against the kernels they replace: the residual and the normed row equal, the products
    within bfloat16's rounding of the same sums (accumulated in another order)."""
    from worker.layers.fused import fused_ops

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ops = fused_ops(torch.empty(1, device=dev, dtype=dt))
    x, residual = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
    norm_weight = torch.rand(k, device=dev, dtype=dt) + 0.5
    weight = torch.randn(n, k, device=dev, dtype=dt) * 0.02
    assert gemv.row_fusion_applies(Kernels(), x, weight)
    a, b = x.clone(), residual.clone()
    ops.fused_add_rmsnorm(a, b, norm_weight, 1e-6)
    for one_block in (False, True) if k <= NORM_MAX_K else (False,):
        got, new_residual, normed = gemv.norm_linear(
            x, residual, norm_weight, 1e-6, weight, write_normed=True, one_block=one_block
        )
        assert torch.equal(new_residual, b)
        torch.testing.assert_close(normed, a, rtol=0.008, atol=0.008)  # at most one bfloat16 step apart
        torch.testing.assert_close(got, gemv.small_linear(a, weight), rtol=0.02, atol=0.02)
    gate_up = torch.randn(1, 2 * k, device=dev, dtype=dt)
    down = torch.randn(k // 2, k, device=dev, dtype=dt) * 0.02
    ref = gemv.small_linear(ops.silu_and_mul(gate_up), down)
    torch.testing.assert_close(gemv.silu_linear(gate_up, down), ref, rtol=0.02, atol=0.02)
