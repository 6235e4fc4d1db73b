"""A mixture of experts' FP8 weights (Qwen3-MoE's FP8 releases, compressed-tensors' FP8-dynamic ones, or
`quantization="fp8"`). Where the fused expert kernels run (worker/layers/moe/fused.py) the experts stay
e4m3, each row's scales laid out for its rank's slice (ExpertScales): a checkpoint's e4m3 weights load
into e4m3 parameters, and an unquantized checkpoint's experts are quantized as each tensor is read (random
weights once drawn), a scale an output row. Elsewhere (the torch loop), or where a checkpoint's blocks do
not fit the kernels' groups, a checkpoint's experts are dequantized to the model's dtype once loaded. The
other linears stay FP8 (worker/quant/prepare.py)."""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from worker.checkpoint_error import CheckpointError
from worker.layers.moe.weights import ExpertDown, ExpertGateUp, Experts
from worker.quant.fp8 import FP8, check_fp8, quantize_per_channel
from worker.quant.scheme import Fp8Scheme, QuantizationError


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertGateUp | ExpertDown)]


def attach_expert_scales(
    model: nn.Module, scheme: Fp8Scheme, keep_fp8: bool = False, dtype: torch.dtype | None = None
) -> int:
    """Gives each stacked expert projection the checkpoint quantizes a parameter for its scales, named as
    the checkpoint names them (`weight_scale_inv`: a block's; `weight_scale`: an output channel's), every
    expert's whole (a rank takes its slice from them), and a weight loader that checks what it reads;
    returns how many it gave. The scheme's ignore list is read with the checkpoint's names of the module's
    experts: all of them left out leaves it unquantized, some of them is an error. `keep_fp8` (the fused
    kernels run the experts): a block whose two projections are both quantized, in groups the kernels
    take (scale_group), gets e4m3 weights for the checkpoint's to load into (keep_expert_scales then lays
    out the scales); the others load into the model's dtype (`dtype`, torch's default unless given;
    dequantize_experts), made anew where the model made them e4m3 (weights.experts_made_in)."""
    made = 0
    for name, module in expert_modules(model):
        if _left_out(model, name, module, scheme):
            continue
        experts, rows, cols = _full_shape(module)
        if scheme.block is not None:
            grid: tuple[int, ...] = (-(-rows // scheme.block[0]), -(-cols // scheme.block[1]))
        else:
            grid = (rows,)
        parts = (2,) if isinstance(module, ExpertGateUp) else ()
        scale = torch.empty(experts, *parts, *grid, dtype=torch.float32, device=module.weight.device)
        module.register_parameter(scheme.scale_name, nn.Parameter(scale, requires_grad=False))
        module.weight_loader = functools.partial(_load, module, module.weight_loader, grid, scheme)
        made += 1
    for block in _blocks(model):
        parts = (block.gate_up_proj, block.down_proj)
        kept = keep_fp8 and all(hasattr(p, scheme.scale_name) and _fits_every_rank(p, scheme.block) for p in parts)
        want = FP8 if kept else dtype or torch.get_default_dtype()
        for p in parts:
            if p.weight.dtype != want:
                p.weight = nn.Parameter(torch.empty_like(p.weight, dtype=want), requires_grad=False)
    return made


def _left_out(model: nn.Module, name: str, module: nn.Module, scheme: Fp8Scheme) -> bool:
    """Whether the scheme's ignore list leaves every expert's part of this projection unquantized (an
    expert's part is left out where the list names it under any of its checkpoint names); some of them is an
    error, as the experts are one stacked weight."""
    names = _checkpoint_names(name, getattr(model, "packed", {}), module.weight.shape[0])
    skipped = [any(map(scheme.skips, units)) for units in names]
    if any(skipped) and not all(skipped):
        raise QuantizationError(
            f"the checkpoint quantizes some of the experts in {name} but not all, which this server stacks into "
            "one weight"
        )
    return all(skipped)


def _blocks(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def scale_group(module: nn.Module, block: tuple[int, int] | None, rank: int | None = None) -> int | None:
    """The columns of a rank's weight (this module's rank unless `rank`) that share a scale in the fused
    kernels (ExpertScales' group; 0: a row's columns all), for a checkpoint's blocks (None: per-channel
    scales); None where its blocks do not fit. A group lies inside one block and starts where the rank's
    slice of a row-split weight (down's) does: the largest power of two that divides both the block's width
    and where the slice starts (each block's scale repeated over its groups), which must be at least 16
    columns (the kernels' tiles)."""
    if block is None:
        return 0
    width = block[1]
    local = module.weight.shape[2]
    start = (module.tp.rank if rank is None else rank) * local if isinstance(module, ExpertDown) else 0
    if start // width == (start + local - 1) // width:  # the rank's columns inside one block
        return 0
    group = (start | width) & -(start | width)  # the largest power of two dividing both
    return group if group >= 16 else None


def _fits_every_rank(module: nn.Module, block: tuple[int, int] | None) -> bool:
    # every rank decides alike, without a collective: each keeps e4m3 experts only where all ranks can
    return all(scale_group(module, block, rank) is not None for rank in range(module.tp.size))


def keep_expert_scales(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Lays out each e4m3 expert projection's loaded scales for the fused kernels (ExpertScales): this rank's
    rows, a scale for every `scale_group` columns of its slice; returns how many it laid out."""
    done = 0
    for _, module in expert_modules(model):
        scale = getattr(module, scheme.scale_name, None)
        if scale is None or module.weight.dtype != FP8:
            continue
        group = scale_group(module, scheme.block)
        module.fp8_scales = _local_scales(module, scale, scheme.block, group)
        module.fp8_group = group
        delattr(module, scheme.scale_name)
        del module.weight_loader  # the class's again
        done += 1
    return done


def _local_scales(module: nn.Module, scale: torch.Tensor, block: tuple[int, int] | None, group: int) -> torch.Tensor:
    """[E, this rank's rows, groups of its columns] from the checkpoint's whole scales (attach_expert_scales'
    layout): a block's [E, (2,) rows / bn, cols / bk], each group taking its block's, or a channel's
    [E, (2,) rows]."""
    offset = module.tp.rank * module.local
    device = scale.device
    if block is None:
        if isinstance(module, ExpertGateUp):  # the rank's rows of each part, gate then up
            rows = torch.arange(offset, offset + module.local, device=device)
            return torch.cat([scale[:, p, rows, None] for p in (0, 1)], dim=1).contiguous()
        return scale[:, :, None].contiguous()
    cols = module.weight.shape[2]
    col0 = offset if isinstance(module, ExpertDown) else 0  # where the rank's columns start in a whole row
    blocks = (col0 + torch.arange(0, cols, group or cols, device=device)) // block[1]  # each group's block
    if isinstance(module, ExpertGateUp):
        rows = torch.arange(offset, offset + module.local, device=device) // block[0]
        return torch.cat([scale[:, p][:, rows][:, :, blocks] for p in (0, 1)], dim=1).contiguous()
    rows = torch.arange(module.weight.shape[1], device=device) // block[0]
    return scale[:, rows][:, :, blocks].contiguous()


def quantize_while_loading(model: nn.Module, dtype: torch.dtype) -> int:
    """For `quantization="fp8"` over an unquantized checkpoint: each stacked expert projection the model made
    e4m3 (weights.experts_made_in) gets a scale an output row and a weight loader that quantizes each
    expert's tensor as it is read (in `dtype` first, as a weight loaded into the model would be), so no
    expert is ever held unquantized; returns how many. A row's scale comes from the whole row, as at tp 1:
    down's rows are split across the ranks, so each rank reads its experts' whole down rows."""
    done = 0
    for _, module in expert_modules(model):
        if module.weight.dtype != FP8:
            continue
        experts, rows = module.weight.shape[:2]
        module.fp8_scales = torch.ones(experts, rows, 1, dtype=torch.float32, device=module.weight.device)
        module.fp8_group = 0
        module.weight_loader = functools.partial(_load_quantizing, module, dtype)
        done += 1
    return done


def _load_quantizing(module: nn.Module, dtype: torch.dtype, param, full, shard_id) -> None:
    """One expert's part (gate, up or down), read whole or as the rank's rows, quantized a row at a time."""
    expert, part = shard_id
    offset, device = module.tp.rank * module.local, param.device
    if isinstance(module, ExpertGateUp):  # the rank's rows, each whole
        q, scale = quantize_per_channel(full.narrow(0, offset, module.local).to(device=device, dtype=dtype))
        first = part * module.local
    else:  # every column, for each row's largest magnitude; the rank keeps its columns
        whole = full[:].to(device=device, dtype=dtype)
        q, scale = quantize_per_channel(
            whole.narrow(1, offset, module.local), lambda _: whole.float().abs().amax(dim=1)
        )
        first = 0
    span = slice(first, first + q.shape[0])
    param.data[expert, span] = q
    module.fp8_scales[expert, span, 0] = scale


def quantize_experts(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Quantizes every stacked expert projection (loaded or drawn in the model's dtype) to e4m3 at one
    scale an output row, as quantize_per_channel does a linear's, but those quantized as they loaded and
    a block whose projections the scheme's ignore list leaves out (any of them: the kernels take both or
    neither); down's rows are split across the ranks, so each row's scale comes from the whole row's
    largest magnitude (a collective: every rank calls this alike). Returns how many it quantized; the
    unquantized weights are freed. (Random weights drawn for an FP8 checkpoint's config take a scale a row
    here, where its own experts may have a scale each 128 columns.)"""
    done = 0
    names = {m: n for n, m in model.named_modules()}
    for block in _blocks(model):
        parts = (block.gate_up_proj, block.down_proj)
        if any([_left_out(model, names[p], p, scheme) for p in parts]) or block.scales() is not None:
            continue  # left out, or quantized as they loaded (quantize_while_loading)
        for module in parts:
            _quantize_rows(module)
            done += 1
    return done


def _quantize_rows(module: nn.Module) -> None:
    """One stacked projection to e4m3 at one scale an output row (quantize_experts), an expert at a time."""
    w = module.weight.data
    whole_rows = None  # down's rows at tp > 1: each whole row's largest magnitude, from every rank's columns
    if isinstance(module, ExpertDown) and module.tp.size > 1:
        whole_rows = module.tp.comm.max_over_ranks(torch.stack([w[e].abs().amax(dim=1).float() for e in range(len(w))]))
    q = torch.empty_like(w, dtype=FP8)
    scales = torch.empty(w.shape[0], w.shape[1], 1, dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        row_max = None if whole_rows is None else (lambda _, m=whole_rows[e]: m)
        q[e], scales[e, :, 0] = quantize_per_channel(w[e], row_max)
    module.weight = nn.Parameter(q, requires_grad=False)
    module.fp8_scales = scales
    module.fp8_group = 0


def _load(module: nn.Module, load_weight, grid: tuple[int, ...], scheme: Fp8Scheme, param, full, shard_id) -> None:
    """An FP8 expert's e4m3 weight (its rank's slice, read into the model's dtype exactly), or its scales,
    whole: a block's [rows / bn, cols / bk], or an output channel's [rows] or [rows, 1], or one for the
    whole tensor."""
    if param is module.weight:
        check_fp8(full)
        load_weight(param, full, shard_id)
        return
    expert, part = shard_id
    values = full[:].float()
    if values.numel() == 1 and scheme.block is None:  # per tensor: every row's
        values = values.reshape(()).expand(grid)
    elif values.shape != grid and not (scheme.block is None and values.shape == (*grid, 1)):
        raise CheckpointError(
            f"an FP8 expert's {scheme.scale_name} is {list(values.shape)}, not {list(grid)} "
            f"(weight_block_size {list(scheme.block) if scheme.block else None})"
        )
    (param.data[expert, part] if isinstance(module, ExpertGateUp) else param.data[expert]).copy_(values.reshape(grid))


def dequantize_experts(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Multiplies each stacked expert weight that has scales (its e4m3 values, read into the model's dtype
    exactly) by them, this rank's slice of them, and drops them; returns how many it dequantized. (Those
    keep_expert_scales laid out have none left.)"""
    done = 0
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
        del module.weight_loader  # the class's again
        done += 1
    return done


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


def _checkpoint_names(name: str, packed: dict[str, tuple[str, int]], experts: int) -> list[list[str]]:
    """A stacked expert projection's checkpoint names, a list for each expert's part (`experts.{e}.`): each
    of our names taken back to those it packs or renames (`gate_up_proj`'s first part: `gate_proj`, or
    Mixtral's `w1`; Mixtral's `mlp`: `block_sparse_moe`), a checkpoint holding one of them."""
    back: dict[str, list[tuple[str, int]]] = {}
    for theirs, (ours, shard) in packed.items():
        back.setdefault(ours, []).append((theirs, shard))
    *path, last = name.split(".")
    options = [[theirs for theirs, _ in back.get(part, [(part, 0)])] for part in path]
    parts: dict[int, list[str]] = {}
    for theirs, shard in back.get(last, [(last, 0)]):
        parts.setdefault(shard, []).append(theirs)
    at = path.index("experts") + 1
    units = []
    for e in range(experts):
        for alternatives in parts.values():
            prefixes = [".".join(p) for p in itertools.product(*options[:at], [str(e)], *options[at:])]
            units.append([f"{prefix}.{theirs}" for prefix in prefixes for theirs in alternatives])
    return units
