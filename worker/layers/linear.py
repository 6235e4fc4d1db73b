"""Linear layers that keep one rank's shard of a full weight: column-parallel (merged QKV, gate/up) and
row-parallel (all-reduce after the matmul). A layer with a quantization method (`quant`, e.g.
worker/quant/fp8.py's Fp8Weights) loads and multiplies through it instead."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from worker import cublaslt, gemv, skinny_gemm, triton_ops
from worker.checkpoint_error import check_shape
from worker.kernels import Kernels
from worker.parallel import TPGroup

_MADE_IN: ContextVar[torch.dtype | None] = ContextVar("linears_made_in", default=None)


@contextmanager
def linears_made_in(dtype: torch.dtype | None) -> Iterator[None]:
    """The weights of column-, row- and QKV-parallel linears made inside are `dtype` (None: torch's default):
    e4m3 where they are quantized as they load (worker/quant/loading.py), so the model is never made whole
    in the unquantized dtype."""
    token = _MADE_IN.set(dtype)
    try:
        yield
    finally:
        _MADE_IN.reset(token)


def _weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=_MADE_IN.get()), requires_grad=False)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: Kernels = Kernels()
) -> torch.Tensor:
    """F.linear, but on CUDA for one row (batch-1 decode) a Triton GEMV unless Kernels.small_linear is
    off: at M=1 cuBLAS reads these weights well below the memory's bandwidth, and the GEMV nearer it
    (bench/small_gemm.py compares them); at decode batches the Triton GEMM where Kernels.decode_gemm
    chooses it (worker/skinny_gemm.py), else (without a bias, which F.linear adds inside cuBLASLt's product)
    cuBLASLt at the algorithm the engine timed fastest for the shape at start where Kernels.tuned_gemms is
    on (worker/cublaslt.py)."""
    if x.dim() == 2 and x.shape[0] > 0:
        y = None
        if kernels.small_linear and x.shape[0] == 1 and gemv.small_linear_applies(x, weight):
            y = gemv.small_linear(x, weight, pdl=triton_ops.pdl_applies(kernels, x.device))
        elif skinny_gemm.chosen(kernels, x.shape[0], weight) and skinny_gemm.applies(x, weight):
            y = skinny_gemm.matmul(x, weight, x.dtype)
        elif kernels.tuned_gemms and bias is None and x.is_cuda and x.is_contiguous() and weight.is_contiguous():
            product = cublaslt.tuned(x, weight)
            if product is not None:
                y = product(x, weight)
        if y is not None:
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; each rank produces a slice of the outputs.

    `output_sizes` lists the full widths of fused sub-matrices (e.g. gate and up); each one is split
    across ranks separately so that a rank holds matching slices of every part.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup, kernels: Kernels = Kernels()
    ) -> None:
        super().__init__()
        self.tp = tp
        self.small = kernels.small_linear
        self.kernels = kernels
        self.quant = None
        self.local_sizes = [tp.shard(n, "a column-parallel output width") for n in output_sizes]
        self.weight = _weight(sum(self.local_sizes), in_features)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def rows_of(self, shard_id: int) -> tuple[int, int, int]:
        """(first local row, first row in the checkpoint's part, rows) of part `shard_id` on this rank."""
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), self.tp.rank * size, size

    def part_rows(self, shard_id: int) -> int:
        """The output rows of part `shard_id` in the checkpoint (every rank's together)."""
        return self.local_sizes[shard_id] * self.tp.size

    def weight_loader(self, param: nn.Parameter, full, shard_id: int = 0) -> None:
        """`full` is the whole checkpoint tensor (or a lazy view of it); this keeps the rank's shard."""
        dst, src, size = self.rows_of(shard_id)
        rows = self.part_rows(shard_id)
        if param is self.weight:
            check_shape(full, (rows, self.weight.shape[1]), "weight")
        elif param is self.bias:
            check_shape(full, (rows,), "bias")
        if self.quant is not None and param is not self.bias:
            self.quant.load_rows(self, param, full, dst, src, size, rows)
            return
        param.data.narrow(0, dst, size).copy_(full.narrow(0, src, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, self.bias, self.small)
        return linear(x, self.weight, self.bias, self.kernels)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. When there are fewer KV heads than ranks, KV heads are replicated so that
    every rank holds the KV head its query heads attend to."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        kernels: Kernels = Kernels(),
    ) -> None:
        self.num_local_heads = tp.shard(num_heads, "num_attention_heads")
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        if tp.size > num_kv_heads and tp.size % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp.size} must divide or be a multiple of num_key_value_heads {num_kv_heads}"
            )
        self.num_local_kv_heads = max(1, num_kv_heads // tp.size)
        self.head_dim = head_dim
        nn.Module.__init__(self)
        self.tp = tp
        self.small = kernels.small_linear
        self.kernels = kernels
        self.quant = None
        q, kv = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        self.local_sizes = [q, kv, kv]
        self.weight = _weight(q + 2 * kv, hidden)
        self.bias = nn.Parameter(torch.empty(q + 2 * kv), requires_grad=False) if bias else None

    def rows_of(self, shard_id: int) -> tuple[int, int, int]:
        size = self.local_sizes[shard_id]
        rank = self.tp.rank if shard_id == 0 else self.tp.rank // self.kv_replicas
        return sum(self.local_sizes[:shard_id]), rank * size, size

    def part_rows(self, shard_id: int) -> int:
        # replicated kv heads: kv_replicas ranks hold the same slice
        return self.local_sizes[shard_id] * self.tp.size // (self.kv_replicas if shard_id else 1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced across ranks (unless
    `reduce` is off: then the caller reduces them, with others, and no bias is allowed)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        kernels: Kernels = Kernels(),
        reduce: bool = True,
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel linear that leaves the reduce to its caller cannot add a bias")
        self.tp = tp
        self.reduce = reduce
        self.small = kernels.small_linear
        self.kernels = kernels
        self.quant = None
        self.weight = _weight(out_features, tp.shard(in_features, "a row-parallel input width"))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int = 0) -> None:
        rows, size = self.weight.shape
        if param is self.bias:
            check_shape(full, (rows,), "bias")
            param.data.copy_(full[:])
            return
        if param is self.weight:
            check_shape(full, (rows, size * self.tp.size), "weight")
        if self.quant is not None:
            self.quant.load_columns(self, param, full, self.tp.rank * size, size)
            return
        param.data.copy_(full.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.apply(self, x, None, self.small)
        else:
            y = linear(x, self.weight, kernels=self.kernels)
        return self.finish(y)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial products y, all-reduced (unless the caller reduces) and biased."""
        if self.reduce and self.tp.size > 1:
            y = self.tp.comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y
