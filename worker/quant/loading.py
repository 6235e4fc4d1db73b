"""`quantization: fp8` over an unquantized checkpoint, a linear at a time as the checkpoint is read. The
linears are made e4m3 (worker/layers/linear.py's linears_made_in), and the norms whose weights fold into
them (worker/quant/fold.py) are read before anything else (the loader's `load_first`). Each linear's parts
(q, k and v; gate and up), read in the model's dtype as a loaded weight would be, wait in a buffer of its
rows until all of them are in; then the rows are folded, quantized per output row and the buffer freed.
A checkpoint keeps a linear's parts together, so a linear or two at most are held unquantized at once:
quantizing after the load held the whole model in its dtype first. The weights, scales and norms come
out as quantize_linears makes them from the loaded model, bit for bit."""

from __future__ import annotations

import functools

import torch
from torch import nn

from worker.checkpoint_error import CheckpointError
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.quant.fold import norm_folds
from worker.quant.fp8 import FP8, Fp8Weights, quantize_per_channel
from worker.quant.prepare import quantizable_linears
from worker.quant.scheme import Fp8Scheme


class QuantizingLoad(Fp8Weights):
    """The loading method of a linear quantized as it loads; once its rows are quantized the layer's method
    is a plain Fp8Weights of per-channel scales."""

    def __init__(self, layer: nn.Module, name: str, dtype: torch.dtype, norm: RMSNorm | None) -> None:
        super().__init__(None, layer.kernels)
        self.name = name
        self.dtype = dtype
        self.norm = norm
        self.rows: torch.Tensor | None = None  # the unquantized rows read so far
        self.parts: set[int] = set()  # the first local row of each part read
        self.rows_in = 0
        self.row_max: torch.Tensor | None = None  # a row-parallel shard's whole rows' largest magnitudes

    def load_rows(
        self, layer: nn.Module, param: nn.Parameter, full, dst: int, src: int, size: int, part_rows: int
    ) -> None:
        self._arrived(dst)
        self._held(layer).narrow(0, dst, size).copy_(full.narrow(0, src, size))
        self.rows_in += size
        self.finish_if_ready(layer)

    def load_columns(self, layer: nn.Module, param: nn.Parameter, full, src: int, size: int) -> None:
        self._arrived(0)
        rows = self._held(layer)
        rows.copy_(full.narrow(1, src, size))
        self.rows_in = rows.shape[0]
        if layer.tp.size > 1:
            # each row's scale from the whole row's largest magnitude, as at tp 1 (exact in the model's dtype);
            # every rank reads the checkpoint's tensors in one order, so all of them reach this together
            self.row_max = layer.tp.comm.max_over_ranks(rows.abs().amax(dim=1).float())
        self.finish_if_ready(layer)

    def _arrived(self, first_row: int) -> None:
        if first_row in self.parts:
            raise CheckpointError(f"the checkpoint holds a part of {self.name} twice (a stray file beside it?)")
        self.parts.add(first_row)

    def _held(self, layer: nn.Module) -> torch.Tensor:
        if self.rows is None:
            self.rows = torch.empty(layer.weight.shape, dtype=self.dtype, device=layer.weight.device)
        return self.rows

    def finish_if_ready(self, layer: nn.Module) -> None:
        """Quantizes the layer once every row and its folded norm's weight are in."""
        if self.rows_in < layer.weight.shape[0] or (self.norm is not None and not self.norm.loaded):
            return
        w = self.rows.float()
        self.rows = None
        if self.norm is not None:  # fold_into's product, in float32
            w = w * self.norm.weight.data.float()[None, :]
            self.norm.weight.data.fill_(1.0)
            self.norm.folded = True
        row_max = self.row_max
        q, scale = quantize_per_channel(w, None if row_max is None else (lambda _: row_max))
        layer.weight.data.copy_(q)
        self.scale_of(layer).copy_(scale)
        layer.quant = Fp8Weights(None, layer.kernels)


def quantize_linears_while_loading(model: nn.Module, scheme: Fp8Scheme, dtype: torch.dtype, fold_norms: bool) -> int:
    """Gives each linear the scheme (per-channel, quantized at load) quantizes, made e4m3 (linears_made_in),
    its scales and a loader that quantizes it once its tensors are read (QuantizingLoad); one the scheme
    leaves out gets back a weight in `dtype`. `fold_norms`: each norm's weight folds into the linear that
    reads its output, as quantize_linears folds it, and the norms load first (`model.load_first`). Returns
    how many linears quantize as they load."""
    folds = norm_folds(model) if fold_norms else {}
    names = {module: name for name, module in model.named_modules()}
    quantized, first = set(), set()
    for name, module in quantizable_linears(model, scheme):
        if module.weight.dtype != FP8:
            continue
        rows = module.weight.shape[0]
        module.register_buffer(scheme.scale_name, torch.ones(rows, dtype=torch.float32, device=module.weight.device))
        norm = folds.get(module)
        module.quant = QuantizingLoad(module, name, dtype, norm)
        if norm is not None:
            norm.loaded = False
            norm.weight_loader = functools.partial(_norm_loaded, names[norm], norm, module)
            first.add(f"{names[norm]}.weight")
        quantized.add(module)
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear) and module not in quantized:
            if module.weight.dtype == FP8:
                module.weight = nn.Parameter(torch.empty_like(module.weight, dtype=dtype), requires_grad=False)
    model.load_first = first
    return len(quantized)


def _norm_loaded(name: str, norm: RMSNorm, linear: nn.Module, param: nn.Parameter, full, shard_id) -> None:
    if norm.loaded:
        raise CheckpointError(f"the checkpoint holds {name}.weight twice (a stray file beside it?)")
    param.data.copy_(full[:])
    norm.loaded = True
    linear.quant.finish_if_ready(linear)


def check_quantized_while_loading(model: nn.Module) -> None:
    """After the load: every linear that was to quantize as it loaded has (a part or a folded norm missing
    from the checkpoint leaves one waiting); the norms' loaders and the load order go."""
    waiting = [name for name, m in model.named_modules() if isinstance(getattr(m, "quant", None), QuantizingLoad)]
    if waiting:
        raise CheckpointError(
            f"the checkpoint lacks parts of {', '.join(waiting[:8])}{' and more' if len(waiting) > 8 else ''} "
            "(or the norms folded into them): they could not be quantized"
        )
    for module in model.modules():
        if isinstance(module, RMSNorm) and "weight_loader" in module.__dict__:
            del module.weight_loader, module.loaded
    model.__dict__.pop("load_first", None)
