"""The LM head (worker/layers/embedding.py: ParallelLMHead): one row through the Triton GEMV where
Kernels.small_linear asks for it, every other shape through F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import gemv
from worker.kernels import Kernels
from worker.layers.embedding import ParallelLMHead
from worker.parallel import TPGroup


def _head(vocab: int, hidden: int, kernels: Kernels, device: str = "cpu", dtype=torch.float32) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, TPGroup(), kernels).to(device=device, dtype=dtype)
    head.weight.data.normal_(0.0, 0.05)
    return head


@pytest.mark.parametrize("rows,small_linear,gemv_expected", [(1, True, True), (1, False, False), (3, True, False)])
def test_the_gemv_takes_one_row_only_where_small_linear_asks_for_it(rows, small_linear, gemv_expected, monkeypatch):
    calls = []

    def recording_gemv(x: torch.Tensor, weight: torch.Tensor, **kwargs) -> torch.Tensor:
        calls.append((tuple(x.shape), kwargs))
        return F.linear(x, weight)

    monkeypatch.setattr(gemv, "small_linear_applies", lambda x, weight: True)  # as on a GPU
    monkeypatch.setattr(gemv, "small_linear", recording_gemv)
    head = _head(50, 16, Kernels(small_linear=small_linear))
    hidden = torch.randn(rows, 16)
    torch.testing.assert_close(head(hidden), F.linear(hidden, head.weight))
    assert calls == ([((1, 16), {})] if gemv_expected else [])  # no programmatic dependent launch either


def test_on_cpu_the_head_is_f_linear_trimmed_to_the_vocabulary():
    head = _head(50, 16, Kernels())
    hidden = torch.randn(1, 16)
    assert torch.equal(head(hidden), F.linear(hidden, head.weight)[:, :50])


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,hidden", [(151936, 1024), (49152, 576), (1000, 4096)])
def test_on_gpu_one_rows_logits_through_the_gemv_agree_with_cublas(vocab, hidden, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("triton")
    launches = []
    gemv_of = gemv.small_linear

    def counted(*args, **kwargs):
        launches.append(kwargs)
        return gemv_of(*args, **kwargs)

    monkeypatch.setattr(gemv, "small_linear", counted)
    head = _head(vocab, hidden, Kernels(), "cuda", torch.bfloat16)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    got = head(x)
    assert launches == [{}]  # the GEMV ran, without programmatic dependent launch
    want = F.linear(x, head.weight).float()
    exact = x.float() @ head.weight.float().T
    # both sum in float32 and round once to bf16: within a bf16 rounding of the exact logits' scale
    tol = exact.abs().max().item() / 128
    assert (got.float() - exact).abs().max().item() <= tol
    assert (got.float() - want).abs().max().item() <= tol
