"""Batch-1 decode's fused launches (worker/layers/row_fusion.py): a residual norm inside the GEMV after it,
SiLU-and-multiply inside the down projection's, or inside gate-up's epilogue where down's cannot take it
(bf16 and FP8 weights). Against the torch norm, SiLU and matmul in float32 under
Triton's interpreter, and end to end against transformers' greedy output one prompt at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, gated_calls, greedy

from worker import gemv
from worker.kernels import Kernels
from worker.layers import row_fusion
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.row_fusion import (
    NORM_MAX_K,
    SILU_MAX_K,
    gate_up_silu,
    gate_up_silu_applies,
    norm_linear,
    silu_linear,
)
from worker.parallel import TPGroup
from worker.quant import gemm
from worker.quant.fp8 import Fp8Weights, dequantize, quantize_per_channel
from worker.quant.scheme import Fp8Scheme

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


# per channel and block-scaled (blocks of 32 rows and 64 columns: K past one block and not a multiple of it)
@pytest.mark.parametrize("block", [None, (32, 64)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("one_block", [False, True])
def test_norm_linear_over_fp8_weights_equals_the_norm_then_the_dequantized_matmul(block, gated, one_block):
    """The norm inside the FP8 GEMV: e4m3 rows scaled as quant.gemm.fp8_gemv scales them, gated or not
    (silu(gate) * up in the epilogue), against the norm and the matmul over the dequantized weight."""
    torch.manual_seed(3)
    k, n = 200, 37
    q, scale = _fp8(2 * n if gated else n, k, block)
    x, residual, norm = torch.randn(1, k), torch.randn(1, k), _norm(k)
    assert gemv.row_fusion_applies(INTERPRETED, x, q)
    got, new_residual, _ = gemv.norm_linear(
        x, residual, norm.weight, norm.eps, q, scale=scale, block=block, gated=gated, one_block=one_block, block_k=64
    )
    ref = norm(x + residual) @ dequantize(q, scale, block).T
    if gated:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,gated", [(1, False), (1, True), (3, True)])
def test_the_fp8_gemv_with_grouped_block_scales_equals_it_with_a_scale_a_weight(m, gated):
    """Block scales loaded a block at a time and applied to each block's sum: the same product as one scale
    loaded for every weight (K past two steps of two blocks and not a multiple of a block)."""
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")
    torch.manual_seed(m)
    block, k, n = (32, 64), 300, 37
    q, scale = _fp8(2 * n if gated else n, k, block)
    x = torch.randn(m, k)
    want = gemm.fp8_gemv(x, q, scale, block, block_k=128, gated=gated)
    got = gemm.fp8_gemv(x, q, scale, block, block_k=128, gated=gated, grouped=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref = x @ dequantize(q, scale, block).T
    if gated:
        ref = F.silu(ref[:, :n]) * ref[:, n:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of the block's columns"):
        gemm.fp8_gemv(x, q, scale, block, block_k=96, grouped=True)


def test_norm_linear_by_default_loads_the_row_in_one_block_of_at_most_the_measured_tile(monkeypatch):
    """The default: one block, with the columns a program narrowed so the weight tile holds at most
    ONE_BLOCK_MAX_ELEMENTS (2 at Qwen3-8B's 4,096-wide rows, the fastest measured there); an explicit wider
    tile keeps the two passes."""
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    monkeypatch.setattr(gemv, "_kernels", lambda: SimpleNamespace(norm_linear_kernel=Launcher()))

    def launch(k: int, n: int, **kw) -> dict:
        x = torch.empty(1, k, device="meta")
        gemv.norm_linear(x, x, torch.empty(k, device="meta"), 1e-6, torch.empty(n, k, device="meta"), **kw)
        return launches.pop()

    cases = [(1024, 4096, False, 2), (1024, 6144, False, 4), (2048, 5120, False, 4), (4096, 6144, False, 2)]
    cases += [(4096, 24576, False, 2), (4096, 2 * 12288, True, 1)]  # gated: a column's gate and up rows
    for k, n, gated, block_n in cases:
        kw = launch(k, n, gated=gated)
        assert kw["ONE_BLOCK"] and kw["BLOCK_K"] == k and kw["BLOCK_N"] == block_n, (k, n)
        assert kw["BLOCK_N"] * k * (2 if gated else 1) <= gemv.ONE_BLOCK_MAX_ELEMENTS
    kw = launch(4096, 24576, block_n=8)
    assert not kw["ONE_BLOCK"] and kw["BLOCK_N"] == 8 and kw["BLOCK_K"] == 1024
    kw = launch(16384, 4096)  # no column fits one block: the two passes at the default columns
    assert not kw["ONE_BLOCK"] and kw["BLOCK_N"] == 2


@pytest.mark.parametrize("k,n", [(64, 48), (1100, 37), (96, 2500)])
def test_silu_linear_equals_silu_and_multiply_then_the_matmul(k, n):
    torch.manual_seed(k * n)
    gate_up, weight = torch.randn(1, 2 * k), torch.randn(n, k)
    gate, up = gate_up.chunk(2, dim=-1)
    got = gemv.silu_linear(gate_up, weight)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ weight.T, rtol=1e-5, atol=1e-4)


# K past one BLOCK_K (1,024) and not a multiple of it; N past one program's rows and not a multiple; a few rows
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (1, 1100, 37), (1, 96, 2500), (3, 200, 5)])
def test_the_gated_gemv_is_silu_of_the_gate_rows_times_the_up_rows(m, k, n):
    torch.manual_seed(m + k + n)
    x, weight = torch.randn(m, k), torch.randn(2 * n, k) * 0.05
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    got = gemv.small_linear(x, weight, gated=True)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-4)


def _fp8(n: int, k: int, block) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [n, k] and its scales as an FP8 linear holds them (per row; block scales repeated over
    their block's rows)."""
    from fp8_checkpoints import quantize_blocks

    w = torch.randn(n, k) * 0.05
    if block is None:
        return quantize_per_channel(w)
    q, s = quantize_blocks(w, block)
    return q, s.repeat_interleave(block[0], dim=0)[:n].contiguous()


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("m,k,n", [(1, 96, 40), (2, 200, 24), (1, 130, 37)])  # 37: a last program half full
def test_the_gated_fp8_gemv_is_silu_of_the_dequantized_gate_rows_times_the_up_rows(block, m, k, n):
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")
    torch.manual_seed(k * n)
    q, scale = _fp8(2 * n, k, block)
    x = torch.randn(m, k)
    gate, up = (x @ dequantize(q, scale, block).T).chunk(2, dim=-1)
    got = gemm.fp8_gemv(x, q, scale, block, block_k=64, gated=True)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def _mlp_layers(hidden: int, inter: int, kernels: Kernels) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    tp = TPGroup(0, 1)
    gate_up = ColumnParallelLinear(hidden, [inter, inter], bias=False, tp=tp, kernels=kernels)
    down = RowParallelLinear(inter, hidden, bias=False, tp=tp, kernels=kernels)
    gate_up.weight.data.normal_(0, 0.05)
    down.weight.data.normal_(0, 0.05)
    return gate_up, down


def test_the_silu_goes_into_gate_ups_gemv_only_where_downs_cannot_take_it():
    narrow_up, narrow_down = _mlp_layers(16, SILU_MAX_K, INTERPRETED)
    wide_up, wide_down = _mlp_layers(16, SILU_MAX_K + 1, INTERPRETED)
    row = torch.randn(1, 16)
    assert not gate_up_silu_applies(narrow_up, narrow_down, row, INTERPRETED)  # down's GEMV takes it
    assert gate_up_silu_applies(wide_up, wide_down, row, INTERPRETED)
    gate, up = (row @ wide_up.weight.T).chunk(2, dim=-1)
    torch.testing.assert_close(gate_up_silu(wide_up, row, INTERPRETED), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    for x, kernels in [
        (torch.randn(2, 16), INTERPRETED),  # more than one row
        (row, Kernels(interpret_on_cpu=True, fused=False)),
        (row, Kernels(interpret_on_cpu=True, small_linear=False)),
        (row, Kernels()),  # the CPU without the interpreter
    ]:
        up_layer, down_layer = _mlp_layers(16, SILU_MAX_K + 1, kernels)
        assert not gate_up_silu_applies(up_layer, down_layer, x, kernels)
    # FP8: down's GEMV reads its row in bfloat16 and takes no SiLU, so gate-up's applies it at any width
    fp8_up, fp8_down = _mlp_layers(16, 24, INTERPRETED)
    for layer in (fp8_up, fp8_down):
        Fp8Weights.attach(layer, Fp8Scheme(block=None, prequantized=False))
    if gemm._fp8_kernels() is not None:
        assert gate_up_silu_applies(fp8_up, fp8_down, row, INTERPRETED)
        gate, up = (row @ dequantize(fp8_up.weight, fp8_up.weight_scale, None).T).chunk(2, dim=-1)
        torch.testing.assert_close(gate_up_silu(fp8_up, row, INTERPRETED), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert not gate_up_silu_applies(fp8_up, fp8_down, torch.randn(2, 16), INTERPRETED)


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


@pytest.mark.parametrize("norm_fits", [False, True])
def test_batch_1_decode_with_the_silu_in_gate_ups_gemv_equals_hf_greedy(model_paths, monkeypatch, norm_fits):
    """Where the SiLU does not fit down's GEMV (here with its limit at zero: on Qwen3-8B's widths), gate-up's
    GEMV applies it: with the norm inside the same launch where the norm fits (Qwen3-8B's 4,096), or after
    the norm on its own (the norm's limit at zero too); then down's product (on the CPU through torch, as
    outside the interpreter's GEMVs)."""
    path = model_paths["qwen2"]
    if not norm_fits:
        monkeypatch.setattr(row_fusion, "NORM_MAX_K", 0)
    monkeypatch.setattr(row_fusion, "SILU_MAX_K", 0)
    gated = gated_calls(monkeypatch, gemv, "small_linear")
    norm_gated = gated_calls(monkeypatch, gemv, "norm_linear")
    with checked_llm(path, page_size=4, kernels=INTERPRETED) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:2])
        got = [llm.generate([p], greedy(5))[0].token_ids for p in prompts]
    assert got == hf_greedy(path, prompts, 5)
    assert any(norm_gated) is norm_fits and any(gated) is not norm_fits


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
    for one_block in (False, True, None) if k <= NORM_MAX_K else (False,):
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


@pytest.mark.gpu
@pytest.mark.parametrize("block", ["bf16", None, (128, 128)])
def test_on_gpu_the_gated_gemvs_equal_the_gemv_then_flashinfers_silu(block):
    """Qwen3-8B's gate-up (4,096 -> 2 x 12,288) at one row, bf16 and FP8 (per channel, block-scaled): the
    SiLU in the GEMV's epilogue against the GEMV's [gate | up] row through FlashInfer's SiLU-and-multiply,
    within bfloat16's rounding (exp computed another way)."""
    from worker.layers.fused import fused_ops

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ops = fused_ops(torch.empty(1, device=dev, dtype=dt))
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    w = torch.randn(2 * 12288, 4096, device=dev, dtype=dt) * 0.02
    if block == "bf16":
        got, unfused = gemv.small_linear(x, w, gated=True), gemv.small_linear(x, w)
    else:
        q, scale = _fp8(2 * 12288, 4096, block)
        q, scale = q.to(dev), scale.to(dev)
        got, unfused = gemm.fp8_gemv(x, q, scale, block, gated=True), gemm.fp8_gemv(x, q, scale, block)
    torch.testing.assert_close(got, ops.silu_and_mul(unfused), rtol=0.016, atol=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("block", ["bf16", None, (128, 128)])
@pytest.mark.parametrize("gated", [False, True])
def test_on_gpu_the_norm_inside_gate_ups_and_fp8_gemvs_equals_flashinfers_norm_then_the_gemv(block, gated):
    """Qwen3-8B's widths (4,096 -> 6,144, or gate-up's 2 x 12,288 with the SiLU in the epilogue), bf16 and FP8
    (per channel, block-scaled): the norm inside the GEMV against FlashInfer's residual norm then the GEMV
    it replaces, at the default tile and in two passes, within bfloat16's rounding of the same sums."""
    from worker.layers.fused import fused_ops

    torch.manual_seed(0)
    dev, dt, k = "cuda", torch.bfloat16, 4096
    n = 2 * 12288 if gated else 6144
    ops = fused_ops(torch.empty(1, device=dev, dtype=dt))
    x, residual = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
    norm_weight = torch.rand(k, device=dev, dtype=dt) + 0.5
    normed, new_residual = x.clone(), residual.clone()
    ops.fused_add_rmsnorm(normed, new_residual, norm_weight, 1e-6)
    if block == "bf16":
        w, scale, quant = torch.randn(n, k, device=dev, dtype=dt) * 0.02, None, None
        want = gemv.small_linear(normed, w, gated=gated)
    else:
        w, scale = (t.to(dev) for t in _fp8(n, k, block))
        quant = block
        want = gemm.fp8_gemv(normed, w, scale, block, gated=gated)
    for one_block in (None, False):
        got, res_out, _ = gemv.norm_linear(
            x, residual, norm_weight, 1e-6, w, scale=scale, block=quant, gated=gated, one_block=one_block
        )
        assert torch.equal(res_out, new_residual)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
