"""The load step for quantized weights, which the model classes do not see: before a prequantized checkpoint
is read, its linears become FP8 linears with empty weights and scales for the loader to fill; with
`quantization="fp8"`, after the unquantized weights are loaded (or drawn), they are quantized in place, each
output row at one scale at any tensor-parallel size."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.quant.fold import fold_into, norm_folds
from worker.quant.fp8 import Fp8Weights, quantize_per_channel
from worker.quant.gemm import fp8_supported
from worker.quant.scheme import Fp8Scheme, QuantizationError


def check_device(scheme: Fp8Scheme, device: torch.device) -> None:
    """FP8 GEMMs need a GPU that computes in e4m3 (compute capability 8.9: Ada, Hopper, and later)."""
    if device.type == "cuda" and not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        what = "an FP8 checkpoint" if scheme.prequantized else "quantization fp8"
        raise QuantizationError(
            f"{what} needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: serve an unquantized (bf16) checkpoint"
        )


def quantizable_linears(model: nn.Module, scheme: Fp8Scheme) -> Iterator[tuple[str, nn.Module]]:
    """(name, linear) for every column-, row- and QKV-parallel linear of `model` that the scheme quantizes
    (not those its ignore list names); one fused layer the list names only some parts of is an error."""
    parts_of: dict[str, list[str]] = {}
    for part, (ours, _) in getattr(model, "packed", {}).items():
        parts_of.setdefault(ours, []).append(part)
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        prefix, _, last = name.rpartition(".")
        checkpoint_names = [f"{prefix}.{p}" if prefix else p for p in parts_of.get(last, [last])]
        skipped = [scheme.skips(n) for n in checkpoint_names]
        if all(skipped):
            continue
        if any(skipped):
            raise QuantizationError(
                f"the checkpoint quantizes some of {', '.join(checkpoint_names)} but not all, which this server "
                "runs as one fused layer"
            )
        yield name, module


def quantize_linears(model: nn.Module, scheme: Fp8Scheme, fold_norms: bool = False) -> int:
    """Makes every column-, row- and QKV-parallel linear of `model` an FP8 linear, but those the scheme
    leaves unquantized and those FP8 already (quantized as they loaded: worker/quant/loading.py); returns how
    many it made. The unquantized weights it replaces are freed. `fold_norms` (weights quantized here): each
    norm's weight folded into the linear that reads its output first (worker/quant/fold.py)."""
    if fold_norms and scheme.prequantized:
        raise ValueError("a norm's weight folds into weights quantized at load, not into a quantized checkpoint's")
    folds = norm_folds(model) if fold_norms else {}
    made = 0
    for _, module in quantizable_linears(model, scheme):
        if module.quant is not None:
            continue
        if module in folds:
            fold_into(module, folds[module])
        # a row-parallel rank holds a slice of each output row: its scale from the whole row's largest
        # magnitude, as at tp=1 (every rank reaches these layers in the same order)
        shards_rows = isinstance(module, RowParallelLinear) and module.tp.size > 1
        Fp8Weights.attach(module, scheme, module.tp.comm.max_over_ranks if shards_rows else None)
        made += 1
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the bf16 weights' memory back to the device, for the KV cache's budget
    return made


def quantize_lm_head(model: nn.Module) -> None:
    """Makes the model's LM head e4m3 with a float32 scale a vocabulary row (each rank its rows), and keeps
    the unquantized rows as `exact_weight`, over which the head computes its largest logits again
    (ParallelLMHead._refined): a head tied to the embeddings reads them there, so it costs only the e4m3
    copy; an untied head keeps its unquantized weight beside the e4m3 one."""
    head = model.lm_head
    exact = head.weight
    weight, scale = quantize_per_channel(exact.data)
    head.weight = nn.Parameter(weight, requires_grad=False)
    head.register_buffer("weight_scale", scale)
    # a buffer, not a parameter: what a step reads of the head is the e4m3 weight and 16 rows a request
    # (cluster/scheduler/draft.py weighs a draft by its parameters' bytes)
    head.register_buffer("exact_weight", exact.data, persistent=False)
