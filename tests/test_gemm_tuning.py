"""The start-up tuning of linear products (worker/gemm_tuning.py, worker/cublaslt.py) where it needs no GPU:
which layers and row counts it takes, that it stays out of the CPU's way, and that a failure to reach
cuBLASLt leaves the products on F.linear. The products themselves are tested on the GPU
(tests/test_cublaslt.py)."""

from __future__ import annotations

import logging
from dataclasses import replace

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


def _algo(i: int) -> bytes:
    """A stand-in for listed algorithm i's configuration (cuBLASLt's is 64 bytes)."""
    return bytes([i]) * 64


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
    # qkv: 4 query heads and 2 kv heads of 16; gate-up: two parts of 96; not the biased layer (F.linear adds
    # its bias inside the product), the quantized one, nor a layer outside the parallel linears
    assert shapes == {(128, 64), (64, 64), (192, 64), (64, 96)}
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


def _aligned(rows: int, cols: int, offset: int = 0) -> torch.Tensor:
    """A bf16 [rows, cols] tensor whose data starts `offset` bytes past a cuBLASLt-aligned address."""
    room = torch.randn(rows * cols + cublaslt.ALIGNMENT, dtype=torch.bfloat16)
    skip = (-room.data_ptr() % cublaslt.ALIGNMENT + offset) // 2
    return room[skip : skip + rows * cols].view(rows, cols)


def test_the_registry_hands_out_a_product_only_for_its_shape_dtype_and_aligned_operands(registry):
    class Product:
        def __call__(self, x, w):
            raise AssertionError("a tuned product ran on the CPU")

    x, w = _aligned(4, 8), _aligned(6, 8)
    assert cublaslt.tuned(x, w) is None
    registry[(4, 6, 8, torch.bfloat16, None)] = product = Product()
    assert cublaslt.tuned(x, w) is product
    assert cublaslt.tuned(x[:2], w) is None  # other rows
    assert cublaslt.tuned(x, w.float()) is None  # mixed dtypes
    assert cublaslt.tuned(_aligned(4, 8, offset=16), w) is None  # not where the algorithm assumes
    assert cublaslt.tuned(x, _aligned(6, 8, offset=2)) is None
    # linear() takes a tuned product on CUDA tensors only
    torch.testing.assert_close(linear(x, w, kernels=Kernels()), F.linear(x, w))
    cublaslt.forget()
    assert cublaslt.tuned(x, w) is None


def test_the_cache_file_is_under_xdg_cache_home_and_none_without_a_home(monkeypatch, tmp_path):
    monkeypatch.setattr(cublaslt, "CACHE_FILE", None)  # the default, which the test session overrides
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cublaslt.cache_file() == tmp_path / "raylm" / "gemm_tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")

    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(cublaslt.Path, "home", staticmethod(homeless))
    assert cublaslt.cache_file() is None
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "elsewhere.json")
    assert cublaslt.cache_file() == tmp_path / "elsewhere.json"


def test_kept_timings_are_read_back_and_a_missing_or_broken_file_is_none(tmp_path):
    path = tmp_path / "raylm" / "gemm_tuning.json"
    assert cublaslt.read_cache(path) == {}
    key = cublaslt.cache_key("NVIDIA H100 80GB HBM3|cublasLt 130100|cuda 13.0", torch.bfloat16, 256, 4096, 12288)
    assert key.endswith("|bfloat16|256x4096x12288")
    first = {key: {"algo": "03" * 64, "best_us": 46.5, "baseline_us": 53.2}}
    cublaslt.write_cache(path, first)
    assert cublaslt.read_cache(path) == first
    # a later start adds its products to the file, and a product timed again replaces its record
    other = cublaslt.cache_key("NVIDIA H100 80GB HBM3|cublasLt 130100|cuda 13.0", torch.bfloat16, 64, 4096, 12288)
    again = {key: {"algo": "01" * 64, "best_us": 46.0, "baseline_us": 53.0}}
    cublaslt.write_cache(path, {other: first[key]} | again)
    assert cublaslt.read_cache(path) == {key: again[key], other: first[key]}
    assert [p.name for p in path.parent.iterdir()] == ["gemm_tuning.json"]  # no temporary file left behind
    path.write_text("{not json")
    assert cublaslt.read_cache(path) == {}
    path.write_text("[1, 2]")
    assert cublaslt.read_cache(path) == {}


def test_a_cache_that_cannot_be_written_is_left_alone(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cublaslt.write_cache(blocker / "raylm" / "gemm_tuning.json", {"k": {}})  # its folder cannot be made
    assert blocker.read_text() == ""


@pytest.mark.parametrize(
    "record,kept",
    [
        ({"algo": _algo(2).hex(), "best_us": 46.5, "baseline_us": 53.2}, 2),
        ({"algo": _algo(2).hex(), "best_us": 46, "baseline_us": 53}, 2),
        ({"algo": _algo(7).hex(), "best_us": 46.5, "baseline_us": 53.2}, None),  # no longer listed
        ({"algo": _algo(2).hex(), "best_us": None, "baseline_us": 53.2}, None),
        ({"algo": _algo(2).hex(), "best_us": 46.5}, None),
        ({"best": 2, "best_us": 46.5, "baseline_us": 53.2}, None),  # an index, not an algorithm
        (None, None),
        ([2], None),
    ],
)
def test_a_kept_timing_stands_only_for_an_algorithm_still_listed(record, kept):
    listed = [type("Listed", (), {"algo": _algo(i)})() for i in range(4)]
    got = cublaslt.kept_choice(record, listed)
    assert got is (None if kept is None else listed[kept])


class _FakeProduct:
    """LtLinear's part that tune_products uses, on the CPU: three listed algorithms whose timings a test
    sets, the second the fastest; it counts the times it was timed."""

    timings = {"fast": [9.0, 6.0, 8.0], "slow": [9.95, 9.9, 9.85]}  # F.linear takes 10 us
    tuned = 0

    no_algorithm_for: set[int] = set()  # widths the heuristic lists nothing for

    def __init__(self, m, n, k, dtype, device):
        if n in self.no_algorithm_for:
            raise cublaslt.CublasLtError(f"cuBLASLt has no algorithm for {m} x {n} x {k}")
        self.m, self.n, self.k = m, n, k
        self.candidates = [type("Listed", (), {"algo": _algo(i)})() for i in range(3)]
        self.choice, self.best_us, self.baseline_us = self.candidates[0], float("nan"), float("nan")

    @property
    def algo(self):
        return self.choice.algo

    fails_at: int | None = None  # the width whose timing raises

    def tune(self, x, weights, workspace=None):
        assert x.shape == (self.m, self.k) and all(w.shape == (self.n, self.k) for w in weights)
        if self.n == self.fails_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        _FakeProduct.tuned += 1
        times = self.timings["fast" if self.n == 64 else "slow"]
        best = min(range(3), key=times.__getitem__)
        self.choice, self.best_us, self.baseline_us = self.candidates[best], times[best], 10.0
        return times


def test_a_second_start_reads_the_first_ones_timings_and_picks_the_same(tmp_path, monkeypatch, registry):
    monkeypatch.setattr(cublaslt, "LtLinear", _FakeProduct)
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "a GPU|cublasLt 1|cuda 13.0")
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    monkeypatch.setattr(cublaslt, "L2_FLUSH_BYTES", 4096)
    monkeypatch.setattr(_FakeProduct, "tuned", 0)
    shapes, rows, cpu = {(64, 32), (96, 32)}, [2, 8], torch.device("cpu")
    first = cublaslt.tune_products(shapes, rows, torch.float32, cpu)
    assert _FakeProduct.tuned == 4 and not any(r.cached for r in first)
    # the 64-wide products beat F.linear (6 us against 10) and are handed out at their fastest algorithm;
    # the 96-wide ones (9.85 against 10) miss MIN_GAIN and stay on F.linear
    assert {(r.n, r.m): r.chosen for r in first} == {(64, 2): True, (64, 8): True, (96, 2): False, (96, 8): False}
    assert {key[:3]: p.algo for key, p in registry.items()} == {(2, 64, 32): _algo(1), (8, 64, 32): _algo(1)}
    assert len(cublaslt.read_cache(tmp_path / "gemm_tuning.json")) == 4
    cublaslt.forget()
    second = cublaslt.tune_products(shapes, rows, torch.float32, cpu)
    assert _FakeProduct.tuned == 4  # nothing timed again
    assert second == [replace(r, cached=True) for r in first]
    assert {key[:3]: p.algo for key, p in registry.items()} == {(2, 64, 32): _algo(1), (8, 64, 32): _algo(1)}
    # another GPU, or another cuBLASLt, times its products again
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "another GPU|cublasLt 1|cuda 13.0")
    third = cublaslt.tune_products({(64, 32)}, [2], torch.float32, cpu)
    assert _FakeProduct.tuned == 5 and not third[0].cached


def test_a_small_weight_is_timed_over_a_bounded_number_of_copies(tmp_path, monkeypatch, registry):
    """A weight far under L2 ([8, 64]) would need 131,072 copies to pass 128 MB, each a node of every
    candidate's timing graph (a tiny test model's [64, 128] took 8,192: minutes on a GPU): it takes at most
    MAX_WEIGHT_COPIES; a weight of 1 MB or more takes what passes L2."""
    seen: list[int] = []
    monkeypatch.setattr(_FakeProduct, "tune", lambda self, x, weights, workspace=None: seen.append(len(weights)))
    monkeypatch.setattr(cublaslt, "LtLinear", _FakeProduct)
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "a GPU|cublasLt 1|cuda 13.0")
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    cublaslt.tune_products({(8, 64)}, [2], torch.bfloat16, torch.device("cpu"))
    assert seen == [cublaslt.MAX_WEIGHT_COPIES]
    assert cublaslt.weight_copies(8, 64, torch.bfloat16) == cublaslt.MAX_WEIGHT_COPIES
    assert cublaslt.weight_copies(1024, 512, torch.bfloat16) == cublaslt.L2_FLUSH_BYTES >> 20
    assert cublaslt.weight_copies(151_936, 4096, torch.bfloat16) == 1


def test_a_timing_that_fails_midway_hands_out_no_product(tmp_path, monkeypatch, registry):
    monkeypatch.setattr(cublaslt, "LtLinear", _FakeProduct)
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "a GPU|cublasLt 1|cuda 13.0")
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    monkeypatch.setattr(cublaslt, "L2_FLUSH_BYTES", 4096)
    monkeypatch.setattr(_FakeProduct, "fails_at", 96)  # the second shape: the first's winners are timed by then
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cublaslt.tune_products({(64, 32), (96, 32)}, [2, 8], torch.float32, torch.device("cpu"))
    assert registry == {}
    assert cublaslt.read_cache(tmp_path / "gemm_tuning.json") == {}


def test_a_winner_of_an_earlier_tuning_that_loses_now_goes_back_to_f_linear(tmp_path, monkeypatch, registry):
    monkeypatch.setattr(cublaslt, "LtLinear", _FakeProduct)
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "a GPU|cublasLt 1|cuda 13.0")
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    monkeypatch.setattr(cublaslt, "L2_FLUSH_BYTES", 4096)
    registry[(2, 96, 32, torch.float32, None)] = object()  # another engine's, on timings that won there
    cublaslt.tune_products({(96, 32)}, [2], torch.float32, torch.device("cpu"))
    assert registry == {}


def test_a_tuning_that_fails_leaves_the_engine_on_f_linear(monkeypatch, caplog, registry):
    registry[(2, 64, 32, torch.bfloat16, 0)] = kept = object()  # an engine started before, its products kept

    def fails_midway(shapes, rows, dtype, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cublaslt, "tune_products", fails_midway)
    with caplog.at_level(logging.WARNING, logger="worker.gemm_tuning"):
        got = gemm_tuning.tune_decode_gemms(_layers(), Kernels(), [2], torch.bfloat16, torch.device("cuda", 0))
    assert got == [] and registry == {(2, 64, 32, torch.bfloat16, 0): kept}
    assert "OutOfMemoryError: CUDA out of memory" in caplog.text


def test_a_shape_with_no_algorithm_stays_on_f_linear_and_the_others_are_tuned(tmp_path, monkeypatch, registry):
    monkeypatch.setattr(cublaslt, "LtLinear", _FakeProduct)
    monkeypatch.setattr(cublaslt, "_platform", lambda device: "a GPU|cublasLt 1|cuda 13.0")
    monkeypatch.setattr(cublaslt, "CACHE_FILE", tmp_path / "gemm_tuning.json")
    monkeypatch.setattr(cublaslt, "L2_FLUSH_BYTES", 4096)
    monkeypatch.setattr(_FakeProduct, "no_algorithm_for", {96})
    got = cublaslt.tune_products({(64, 32), (96, 32)}, [2], torch.float32, torch.device("cpu"))
    assert [(r.m, r.n, r.chosen) for r in got] == [(2, 64, True)]
    assert list(registry) == [(2, 64, 32, torch.float32, None)]


@pytest.mark.parametrize("announce", [True, False])
def test_only_the_announcing_rank_logs_the_tuning(monkeypatch, caplog, announce):
    made = [cublaslt.TunedProduct(2, 64, 64, 10.0, 8.0, True), cublaslt.TunedProduct(2, 128, 64, 10.0, 9.9, False)]
    monkeypatch.setattr(cublaslt, "tune_products", lambda shapes, rows, dtype, device: made)
    with caplog.at_level(logging.INFO, logger="worker.gemm_tuning"):
        got = gemm_tuning.tune_decode_gemms(
            _layers(), Kernels(), [1, 2], torch.bfloat16, torch.device("cuda", 0), announce=announce
        )
    assert got == made
    # at 2 rows the two shapes take 8.0 + 10.0 us against cuBLAS's 20.0
    assert ("1 of them now on a faster cuBLASLt algorithm" in caplog.text) is announce
    assert ("take 18.0 us against cuBLAS's 20.0" in caplog.text) is announce
