"""A mixture of experts' FP8 checkpoint (Qwen3-MoE's FP8 releases, compressed-tensors' FP8-dynamic ones):
its experts' e4m3 weights and scales are read into the stacked expert parameters and dequantized there to
the model's dtype once loaded. The expert kernels (worker/layers/moe/) read bf16 weights; FP8 ones would
halve the experts' bytes, and are not written yet, so such a checkpoint's experts take the memory of an
unquantized one. Its other linears stay FP8 (worker/quant/prepare.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.layers.moe.weights import ExpertDown, ExpertGateUp
from worker.quant.scheme import Fp8Scheme

log = logging.getLogger(__name__)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertGateUp | ExpertDown)]


def attach_expert_scales(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Gives each stacked expert projection a parameter for the checkpoint's scales, named as the
    checkpoint names them (`weight_scale_inv`: a block's; `weight_scale`: an output channel's), every expert's
    whole (a rank dequantizes its slice from them); returns how many it gave."""
    made = 0
    for name, module in expert_modules(model):
        if scheme.skips(name):
            continue
        experts, rows, cols = _full_shape(module)
        if scheme.block is not None:
            bn, bk = scheme.block
            grid = (-(-rows // bn), -(-cols // bk))
        else:
            grid = (rows,)
        parts = (2,) if isinstance(module, ExpertGateUp) else ()
        scale = torch.empty(experts, *parts, *grid, dtype=torch.float32, device=module.weight.device)
        module.register_parameter(scheme.scale_name, nn.Parameter(scale, requires_grad=False))
        made += 1
    return made


def dequantize_experts(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Multiplies each stacked expert weight (its e4m3 values, read into the model's dtype exactly) by its
    scales, this rank's slice of them, and drops the scales."""
    for _, module in expert_modules(model):
        scale = getattr(module, scheme.scale_name, None)
        if scale is None:
            continue
        w = module.weight.data
        offset = module.tp.rank * module.local
        for e in range(w.shape[0]):  # an expert at a time: float32 copies of one expert's weight at most
            if isinstance(module, ExpertGateUp):  # [E, 2 * local, H]: gate rows, then up rows
                for part in (0, 1):
                    rows = slice(part * module.local, (part + 1) * module.local)
                    w[e, rows] = _scaled(w[e, rows], scale[e, part], scheme.block, offset, 0)
            else:  # [E, H, local]: the rank's input columns
                w[e] = _scaled(w[e], scale[e], scheme.block, 0, offset)
        delattr(module, scheme.scale_name)
    experts = expert_modules(model)
    if experts:
        dtype = experts[0][1].weight.dtype
        log.warning(
            "this FP8 checkpoint's experts are dequantized to %s at load (the expert kernels read %s weights): "
            "they take the memory of an unquantized checkpoint's experts",
            dtype,
            dtype,
        )


def _scaled(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, row0: int, col0: int) -> torch.Tensor:
    """w [R, C] (a slice starting at row row0 and column col0 of an expert's whole weight) times its scales:
    scale [rows / bn, cols / bk] per block, or [rows] per output row; in float32, rounded once."""
    rows, cols = w.shape
    r = torch.arange(row0, row0 + rows, device=w.device)
    if block is None:
        factor = scale[r, None]
    else:
        c = torch.arange(col0, col0 + cols, device=w.device)
        factor = scale[r // block[0]][:, c // block[1]]
    return (w.float() * factor).to(w.dtype)


def _full_shape(module: nn.Module) -> tuple[int, int, int]:
    """(experts, output rows, input columns) of one part of each expert's whole weight."""
    experts = module.weight.shape[0]
    inter = module.local * module.tp.size
    if isinstance(module, ExpertGateUp):
        return experts, inter, module.weight.shape[2]
    return experts, module.weight.shape[1], inter
