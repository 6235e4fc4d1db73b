"""An engine's start-up step that times its linear layers' products at its CUDA graphs' batch sizes through
cuBLASLt's algorithms against cuBLAS's own pick (worker/cublaslt.py), before the KV cache takes the memory
the timing's operands need."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from worker import cublaslt
from worker.kernels import Kernels
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


def linear_shapes(model: nn.Module, dtype: torch.dtype) -> set[tuple[int, int]]:
    """The (n, k) weight shapes of the model's unquantized column-, QKV- and row-parallel linears in `dtype`
    without a bias: those whose products worker/layers/linear.py's `linear` may hand to a tuned algorithm (a
    biased product stays on F.linear, which adds the bias in cuBLASLt's epilogue)."""
    return {
        tuple(m.weight.shape)
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        and m.quant is None
        and m.bias is None
        and m.weight.dtype == dtype
    }


def tuned_rows(graph_batch_sizes: list[int], kernels: Kernels) -> list[int]:
    """The row counts to tune: every graph batch size, but one row where the Triton GEMV takes it."""
    return [bs for bs in graph_batch_sizes if bs > 1 or not kernels.small_linear]


def tune_decode_gemms(
    model: nn.Module,
    kernels: Kernels,
    graph_batch_sizes: list[int],
    dtype: torch.dtype,
    device: torch.device,
    announce: bool = True,
) -> list[cublaslt.TunedProduct]:
    """Tunes the model's linear products at the graphs' batch sizes where Kernels.tuned_gemms asks for it
    on a GPU in half precision; logs how many beat cuBLAS's pick and by how much where `announce` (a
    tensor-parallel replica's first rank: every rank tunes its own shards). Nothing where cuBLASLt cannot be
    reached (the products stay on F.linear, with a warning from any rank)."""
    if not kernels.tuned_gemms or device.type != "cuda" or dtype not in _HALF or not graph_batch_sizes:
        return []
    shapes, rows = linear_shapes(model, dtype), tuned_rows(graph_batch_sizes, kernels)
    if not shapes or not rows:
        return []
    start = time.perf_counter()
    failure = None
    try:
        results = cublaslt.tune_products(shapes, rows, dtype, device)
    except Exception as exc:  # a speed-up only: whatever fails here, the engine starts on F.linear
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        # the failure's traceback (and the operands its frames held) is gone: their memory goes back to the
        # GPU before the KV cache is sized from what is free
        torch.cuda.empty_cache()
        logger.warning("linear products stay on cuBLAS's own algorithms: %s", failure)
        return []
    if not announce:
        return results
    top = [r for r in results if r.m == max(rows)]
    logger.info(
        "tuned %d linear products in %.1f s (%d timed, the others' timings kept from an earlier start), %d of "
        "them now on a faster cuBLASLt algorithm; at %d rows a layer's %d shapes take %.1f us against cuBLAS's %.1f",
        len(results),
        time.perf_counter() - start,
        sum(not r.cached for r in results),
        sum(r.chosen for r in results),
        max(rows),
        len(top),
        sum(r.best_us if r.chosen else r.baseline_us for r in top),
        sum(r.baseline_us for r in top),
    )
    return results
