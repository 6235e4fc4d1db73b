"""A residual norm's weight folded into the linear that reads its output, where that linear's weights are
quantized at load: W' = W diag(g), quantized per output channel, and the norm's weight set to ones. The
model computes the same function (W (n * g) = W' n for the unit-weight norm n), at every row count, and at
batch 1 the FP8 GEMV that computes the norm itself (Kernels.fp8_norms folded, worker/layers/row_fusion.py)
reads nothing beside its row and its weights. e4m3 is a floating format, so scaling a column changes the
relative error of none of its weights (but those the row's scale pushes under e4m3's normal range).
A checkpoint quantized already is not folded: its weights would be quantized twice."""

from __future__ import annotations

from torch import nn

from worker.layers.norm import RMSNorm


def norm_folds(model: nn.Module) -> dict[nn.Module, RMSNorm]:
    """linear -> the norm whose weight folds into its input columns, over every layer of `model` that
    names such pairs (`norm_folds()`: worker/models/llama.py's DecoderLayer)."""
    folds: dict[nn.Module, RMSNorm] = {}
    for module in model.modules():
        pairs = getattr(module, "norm_folds", None)
        if callable(pairs):
            for norm, linear in pairs():
                folds[linear] = norm
    return folds


def fold_into(linear: nn.Module, norm: RMSNorm) -> None:
    """linear's weight [N, K] times the norm's weight on its columns, in float32 (quantized next, so not
    rounded to the model's dtype first); the norm's weight becomes ones."""
    if norm.folded:
        raise ValueError("this norm's weight is folded into a linear already")
    linear.weight.data = linear.weight.data.float() * norm.weight.data.float()[None, :]
    norm.weight.data.fill_(1.0)
    norm.folded = True
