"""The start-up tuning of linear products (worker/gemm_tuning.py, worker/cublaslt.py) where it needs no GPU:
which layers and row counts it takes, that it stays out of the CPU's way, and that a failure to reach
cuBLASLt leaves the products on F.linear. The products themselves are tested on the GPU
(tests/test_cublaslt.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker import cublaslt, gemm_tuning
from worker.config import EngineConfig
from worker.engine import Engine
from worker.kernels import Kernels
from worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, linear
from worker.parallel import TPGroup


def _layers(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    with torch.device("cpu"):
        tp = TPGroup()
        model = nn.ModuleDict(
            {
                "qkv": QKVParallelLinear(64, 16, 4, 2, False, tp),
                "o": RowParallelLinear(64, 64, False, tp),
                "gate_up": ColumnParallelLinear(64, [96, 96], False, tp),
                "down": RowParallelLinear(96, 64, False, tp),
                "biased": ColumnParallelLinear(32, [48], True, tp),
                "quantized": ColumnParallelLinear(64, [80], False, tp),
                "plain": nn.Linear(64, 72, bias=False),
            }
        )
    model["quantized"].quant = object()  # a layer that multiplies through its quantization method
    return model.to(dtype)


def test_the_shapes_tuned_are_the_unquantized_parallel_linears_in_the_models_dtype():
    shapes = gemm_tuning.linear_shapes(_layers(), torch.bfloat16)
    # qkv: 4 query heads and 2 kv heads of 16; gate-up: two parts of 96; the biased layer too (its bias is
    # added after the product); not the quantized layer, nor a layer outside the parallel linears
    assert shapes == {(128, 64), (64, 64), (192, 64), (64, 96), (48, 32)}
    assert gemm_tuning.linear_shapes(_layers(), torch.float16) == set()


def test_one_row_is_tuned_only_where_the_triton_gemv_does_not_take_it():
    sizes = [1, 2, 4, 8, 16]
    assert gemm_tuning.tuned_rows(sizes, Kernels()) == [2, 4, 8, 16]
    assert gemm_tuning.tuned_rows(sizes, Kernels(small_linear=False)) == sizes


def test_nothing_is_tuned_on_the_cpu_in_float32_or_with_tuning_off(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("tune_products ran")

    monkeypatch.setattr(cublaslt, "tune_products", must_not_run)
    model, sizes = _layers(), [1, 2, 4]
    assert gemm_tuning.tune_decode_gemms(model, Kernels(), sizes, torch.bfloat16, torch.device("cpu")) == []
    cuda = torch.device("cuda", 0)  # a device object only: nothing is run on it below
    assert gemm_tuning.tune_decode_gemms(model.float(), Kernels(), sizes, torch.float32, cuda) == []
    assert gemm_tuning.tune_decode_gemms(_layers(), Kernels(tuned_gemms=False), sizes, torch.bfloat16, cuda) == []
    assert gemm_tuning.tune_decode_gemms(_layers(), Kernels(), [], torch.bfloat16, cuda) == []


def test_a_gpu_whose_cublaslt_cannot_be_reached_keeps_f_linear_and_says_so(monkeypatch, caplog):
    def unreachable(*args, **kwargs):
        raise cublaslt.CublasLtError("libcublasLt is not loaded in this process")

    monkeypatch.setattr(cublaslt, "tune_products", unreachable)
    with caplog.at_level(logging.WARNING, logger="worker.gemm_tuning"):
        got = gemm_tuning.tune_decode_gemms(_layers(), Kernels(), [2, 4], torch.bfloat16, torch.device("cuda", 0))
    assert got == []
    assert "stay on cuBLAS's own algorithms" in caplog.text and "libcublasLt is not loaded" in caplog.text


def test_a_cpu_engine_tunes_nothing(qwen3_path):
    engine = Engine(EngineConfig(str(qwen3_path), dtype="float32", num_pages=64, max_running_reqs=4))
    assert engine.gemm_tuning == []
    assert Kernels().tuned_gemms


@pytest.fixture
def registry():
    yield cublaslt._TUNED
    cublaslt.forget()


def test_the_registry_hands_out_a_product_only_for_its_shape_and_dtype(registry):
    class Product:
        def __call__(self, x, w):
            raise AssertionError("a tuned product ran on the CPU")

    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    assert cublaslt.tuned(x, w) is None
    registry[(4, 6, 8, torch.bfloat16, None)] = product = Product()
    assert cublaslt.tuned(x, w) is product
    assert cublaslt.tuned(x[:2], w) is None  # other rows
    assert cublaslt.tuned(x, w.float()) is None  # mixed dtypes
    # linear() takes a tuned product on CUDA tensors only
    torch.testing.assert_close(linear(x, w, kernels=Kernels()), F.linear(x, w))
    cublaslt.forget()
    assert cublaslt.tuned(x, w) is None
