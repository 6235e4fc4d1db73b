"""The residual norms of an FP8 model at batch 1 without launches of their own: the residual add in the
epilogue of the GEMV before (o and down), the RMS norm inside the FP8 GEMV after (qkv and gate-up) in the
same pass over the row, and, where the weights are quantized at load, the norm's weight folded into them.
Kernels under Triton's interpreter against torch; the fold against the unfolded model; end to end against
the norms run apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.quant import gemm
from worker.quant.fp8 import dequantize, quantize_per_channel

EPS = 1e-6


def _rms(h: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return normed if weight is None else normed * weight


def _needs_triton() -> None:
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")


# K past one step (block_k 128) and not a multiple of it; N past one program's rows and not a multiple
@pytest.mark.parametrize("k,n", [(300, 37), (64, 9)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_the_fp8_gemv_over_the_rms_norm_of_its_row_equals_the_norm_then_the_dequantized_matmul(k, n, with_weight, gated):
    """rstd factors out of every output, so the one pass that reads the row sums its squares too: the same
    product as the norm first (in float32, unrounded) then the GEMV."""
    _needs_triton()
    torch.manual_seed(k + n)
    q, scale = quantize_per_channel(torch.randn(2 * n if gated else n, k) * 0.05)
    h = torch.randn(1, k) * 3
    weight = torch.rand(k) + 0.5 if with_weight else None
    got = gemm.fp8_gemv(h, q, scale, None, block_k=128, gated=gated, norm=gemm.RowNorm(weight, EPS))
    ref = _rms(h, weight) @ dequantize(q, scale, None).T
    if gated:
        ref = F.silu(ref[:, :n]) * ref[:, n:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_the_fp8_gemv_over_block_scaled_weights_takes_the_norm_too():
    _needs_triton()
    from fp8_checkpoints import quantize_blocks

    torch.manual_seed(0)
    block, k, n = (16, 32), 200, 40
    q, s = quantize_blocks(torch.randn(n, k) * 0.05, block)
    s = s.repeat_interleave(block[0], dim=0)[:n].contiguous()
    h, weight = torch.randn(1, k), torch.rand(k) + 0.5
    got = gemm.fp8_gemv(h, q, s, block, block_k=64, norm=gemm.RowNorm(weight, EPS))
    torch.testing.assert_close(got, _rms(h, weight) @ dequantize(q, s, block).T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_added_in_the_fp8_gemvs_epilogue_is_the_rounded_product_plus_the_residual(dtype):
    """As the GEMV's output, rounded to its dtype, then the add, rounded again."""
    _needs_triton()
    torch.manual_seed(1)
    k, n = 300, 37
    q, scale = quantize_per_channel(torch.randn(n, k) * 0.05)
    x, res = torch.randn(1, k).to(dtype), torch.randn(1, n).to(dtype)
    plain = gemm.fp8_gemv(x, q, scale, None, block_k=128)
    got = gemm.fp8_gemv(x, q, scale, None, block_k=128, residual=res)
    assert got.dtype == dtype
    # exact in float32; in bfloat16 within a unit of the last place, as the interpreter rounds its casts
    # to bfloat16 its own way (not the GPU's round to nearest)
    ulp = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, (plain.float() + res.float()).to(dtype), rtol=ulp, atol=0)


def test_the_norm_and_the_residual_inside_the_fp8_gemv_take_one_row_and_a_row_of_its_outputs():
    _needs_triton()
    q, scale = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(ValueError, match="one row"):
        gemm.fp8_gemv(torch.randn(2, 16), q, scale, None, norm=gemm.RowNorm(None, EPS))
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        gemm.fp8_gemv(torch.randn(1, 16), q, scale, None, residual=torch.randn(1, 7))
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        gemm.fp8_gemv(torch.randn(1, 16), q, scale, None, gated=True, residual=torch.randn(1, 4))
