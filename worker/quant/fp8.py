"""FP8 weights of one linear layer: an e4m3 weight and its float32 scales, per output channel
(`weight_scale` [N]) or per [bn, bk] block (`weight_scale_inv`, compressed-tensors' `weight_scale`, kept as
[N, ceil(K / bk)]: each row holds its
block row's scales, so fused parts of any size, and tensor-parallel shards that cut a block row, sit side by
side). Its loader keeps a rank's shard of the weight and of the scales; its GEMM is gemm.fp8_linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.kernels import Kernels
from worker.loader import CheckpointError
from worker.quant import gemm
from worker.quant.scheme import Fp8Scheme, QuantizationError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_per_channel(
    weight: torch.Tensor, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scales [N]) with weight ~= e4m3 * scale, each row's largest
    magnitude at 448 (round to nearest, as torch converts). `row_max`: the rows' largest magnitudes [N]
    -> those of the whole rows, where `weight` holds a slice of each (a tensor-parallel rank's columns of
    a row-parallel layer), so that every rank scales a row as one rank holding all of it would."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    if row_max is not None:
        amax = row_max(amax)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 weight an e4m3 weight and its scales stand for (scales as an Fp8Weights layer keeps them)."""
    if block is None:
        return weight.float() * scale[:, None]
    k = weight.shape[1]
    return weight.float() * scale.repeat_interleave(block[1], dim=1)[:, :k]


class Fp8Weights:
    """The quantization method of a column-, row- or QKV-parallel linear whose weight is e4m3."""

    def __init__(self, block: tuple[int, int] | None, kernels: Kernels, scale_name: str | None = None) -> None:
        self.block = block
        self.kernels = kernels
        # the layer's scales, named as its checkpoint names them (Fp8Scheme.scale_name)
        self.scale_name = scale_name or Fp8Scheme(block=block).scale_name

    @staticmethod
    def attach(
        layer: nn.Module, scheme: Fp8Scheme, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Makes `layer` an FP8 linear. A prequantized scheme gives it empty e4m3 weights and scales for the
        checkpoint to fill; otherwise its loaded (or random) weight is quantized now, per output channel
        (`row_max`: as quantize_per_channel's)."""
        n, k = layer.weight.shape
        device = layer.weight.device
        if (
            scheme.block is not None
            and not gemm.block_width_runs(scheme.block[1])
            and gemm.triton_runs(layer.weight, layer.kernels)
        ):
            raise QuantizationError(
                f"FP8 weight_block_size {list(scheme.block)}: the Triton FP8 kernels take blocks whose columns "
                f"are a power of two from {gemm.MIN_BLOCK_WIDTH} to {gemm.MAX_BLOCK_WIDTH} (published checkpoints "
                "use [128, 128])"
            )
        if scheme.prequantized:
            weight = torch.empty(n, k, dtype=FP8, device=device)
            cols = 1 if scheme.block is None else -(-k // scheme.block[1])
            scale = torch.full((n, cols) if scheme.block else (n,), float("nan"), device=device)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.register_parameter(scheme.scale_name, nn.Parameter(scale, requires_grad=False))
        else:
            weight, scale = quantize_per_channel(layer.weight.data, row_max)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            # computed here, not read from the checkpoint: a buffer, which the loader does not expect
            layer.register_buffer(scheme.scale_name, scale)
        layer.quant = Fp8Weights(scheme.block, layer.kernels, scheme.scale_name)

    def scale_of(self, layer: nn.Module) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    # -- loading: `full` is the whole checkpoint tensor (or a lazy view); a rank keeps its shard --------

    def load_rows(
        self, layer: nn.Module, param: nn.Parameter, full, dst: int, src: int, size: int, part_rows: int
    ) -> None:
        """Output rows [src, src + size) of a (part's) weight or scales into local rows [dst, dst + size); the
        part has `part_rows` rows in the checkpoint."""
        if param is layer.weight:
            check_fp8(full)
            param.data.narrow(0, dst, size).copy_(full.narrow(0, src, size))
            return
        self.check_scales(full, part_rows, layer.weight.shape[1])
        out = param.data.narrow(0, dst, size)
        if self.block is None:
            out.copy_(_per_row(full, src, size))
            return
        bn = self.block[0]
        first, last = src // bn, -(-(src + size) // bn)
        rows = full.narrow(0, first, last - first).float().repeat_interleave(bn, dim=0)
        out.copy_(rows.narrow(0, src - first * bn, size))

    def load_columns(self, layer: nn.Module, param: nn.Parameter, full, src: int, size: int) -> None:
        """Input columns [src, src + size) of a row-parallel weight, and the scales that go with them."""
        if param is layer.weight:
            check_fp8(full)
            param.data.copy_(full.narrow(1, src, size))
            return
        n = param.shape[0]
        self.check_scales(full, n, size * layer.tp.size)
        if self.block is None:
            param.data.copy_(_per_row(full, 0, n))  # every rank holds every output channel
            return
        bn, bk = self.block
        if src % bk:
            raise CheckpointError(
                f"a row-parallel shard starts at input column {src}, inside a {bk}-wide scale block: "
                "choose a tensor-parallel size that splits the layer at block boundaries"
            )
        cols = param.shape[1]
        blocks = full.narrow(1, src // bk, cols)
        param.data.copy_(blocks.float().repeat_interleave(bn, dim=0)[:n])

    def check_scales(self, full, rows: int, cols: int) -> None:
        """The scales of a weight [rows, cols] in the checkpoint: [rows / bn, cols / bk] (rounded up) for
        blocks; [rows] or [rows, 1] per output channel, or one for the whole tensor ([], [1] or [1, 1]).
        Others would load through slicing and broadcasting and scale the wrong weights."""
        shape = tuple(full.shape)
        if self.block is not None:
            bn, bk = self.block
            expected = (-(-rows // bn), -(-cols // bk))
            if shape == expected:
                return
            wanted = f"{list(expected)} (weight_block_size {[bn, bk]} over a weight of {[rows, cols]})"
        else:
            if shape in ((rows,), (rows, 1)) or shape in ((), (1,), (1, 1)):
                return
            wanted = f"[{rows}] or [{rows}, 1] (one a row of a weight of {[rows, cols]}), or one for the whole tensor"
        raise CheckpointError(f"its scales are {list(shape)}, not {wanted}")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, small: bool) -> torch.Tensor:
        return gemm.fp8_linear(x, layer.weight, self.scale_of(layer), self.block, bias, small, self.kernels)


def check_fp8(full) -> None:
    dtype = full.dtype if isinstance(full, torch.Tensor) else full.narrow(0, 0, 1).dtype
    if dtype != FP8:
        raise CheckpointError(f"an FP8 checkpoint's quantized weight is {dtype}, not float8_e4m3fn")


def _per_row(full, src: int, size: int) -> torch.Tensor:
    """Per-channel scales [N] or [N, 1] (a per-tensor one, [1] or [], stands for every row)."""
    t = full[:] if not isinstance(full, torch.Tensor) else full
    t = t.reshape(-1).float()
    return t.expand(size) if t.numel() == 1 else t.narrow(0, src, size)
