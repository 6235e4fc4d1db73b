"""Which FP8 scheme a model runs, read from its checkpoint's `quantization_config` or asked for at load:
`quant_method: "fp8"` (transformers' block scales, `weight_scale_inv`; without `weight_block_size`, AutoFP8's
and vLLM's per-tensor `weight_scale`), compressed-tensors' FP8 (per-channel, per-tensor or block
`weight_scale`), or `quantization="fp8"` on an unquantized checkpoint. Activations are quantized per token
as they run (a block-scaled weight's in groups of the block's width); a checkpoint calibrated with static
per-tensor activation scales (`input_scale`) is served so too."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from worker.loader import CheckpointError

METHODS = ("fp8",)  # what `quantization` may name


class QuantizationError(CheckpointError):
    """A quantization_config (or a `quantization` setting) this server cannot serve."""


@dataclass(frozen=True)
class Fp8Scheme:
    # (rows, columns) of a weight block that shares one scale; None: one scale per output channel
    block: tuple[int, int] | None = None
    # the checkpoint carries fp8 weights and their scales; False: the weights are quantized at load
    prequantized: bool = True
    # module names left unquantized, as the format writes them (see `skips`)
    ignore: tuple[str, ...] = field(default_factory=tuple)
    # the checkpoint's format, which names things its own way: compressed-tensors its ignore entries exactly or
    # as "re:" regexes (transformers' rules differ), and its block scales `weight_scale` (transformers'
    # `weight_scale_inv`)
    ignore_style: str = "transformers"
    # the checkpoint was calibrated with static per-tensor activation scales (`input_scale`), which are not
    # read: activations are quantized per token as they run
    static_activations: bool = False

    @property
    def scale_name(self) -> str:
        """The checkpoint's (and the layer's) name of the weight's scales."""
        return "weight_scale_inv" if self.block is not None and self.ignore_style == "transformers" else "weight_scale"

    def skips(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) stays unquantized."""
        if self.ignore_style == "compressed-tensors":
            return any(
                re.match(p[3:], module) if p.startswith("re:") else module == p or module.endswith("." + p)
                for p in self.ignore
            )
        # transformers' should_convert_module: a prefix (or regex) up to a module boundary, or a suffix
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.ignore)


def scheme_of(config: PretrainedConfig, quantization: str | None) -> Fp8Scheme | None:
    """The scheme for a checkpoint's config and the `quantization` setting; None: unquantized."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if quantization is not None and quantization not in METHODS:
        raise QuantizationError(f"unknown quantization {quantization!r}; choose {', '.join(METHODS)}")
    if qc is None:
        return Fp8Scheme(prequantized=False) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        scheme = _transformers_fp8(qc)
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(qc)
    else:
        raise QuantizationError(
            f"the checkpoint is quantized with {method!r}, which this server does not load; it loads FP8 "
            "checkpoints (quant_method fp8 or compressed-tensors FP8)"
        )
    return scheme


def _transformers_fp8(qc: dict) -> Fp8Scheme:
    """transformers' FineGrainedFP8Config (block scales), or without `weight_block_size` the per-tensor format
    AutoFP8 and vLLM write (`weight_scale` a linear, `input_scale` for static activations)."""
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise QuantizationError(
            f"FP8 activation_scheme {activations!r} is not supported; only dynamic or static (per tensor)"
        )
    if qc.get("scale_fmt", "float") != "float":
        raise QuantizationError(f"FP8 scale_fmt {qc['scale_fmt']!r} is not supported; only float scales")
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise QuantizationError(f"FP8 weight_block_size {block!r} is not supported; give two sizes, e.g. [128, 128]")
    if block is not None and activations == "static":  # as compressed-tensors' blocks, and transformers itself
        raise QuantizationError(
            "FP8 activation_scheme 'static' over block scales (weight_block_size) is not supported; block-scaled "
            "checkpoints quantize their activations dynamically"
        )
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return Fp8Scheme(
        block=None if block is None else (int(block[0]), int(block[1])),
        ignore=tuple(ignore),
        static_activations=activations == "static",
    )


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    """compressed-tensors' FP8 presets: FP8_DYNAMIC (a scale an output channel, dynamic per-token
    activations), FP8 (a scale a weight, static per-tensor activations) and FP8_BLOCK (a scale a block of the
    weight, dynamic activations a scale for each of a token's groups of the block's width)."""
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported; only float-quantized (FP8)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors with {len(groups)} config_groups is not supported; only one")
    ((name, group),) = groups.items()
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise QuantizationError(
            f"compressed-tensors group {name!r} has {weights.get('type')} {weights.get('num_bits')}-bit weights; "
            "only float 8-bit (FP8) weights are supported"
        )
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block") or weights.get("dynamic") or not weights.get("symmetric", True):
        raise QuantizationError(
            f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not supported; "
            "only static symmetric channel, tensor or block scales"
        )
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not structure or len(structure) != 2:
            raise QuantizationError(
                f"compressed-tensors group {name!r}: block scales need a block_structure of two sizes, "
                f"not {structure!r}"
            )
        block = (int(structure[0]), int(structure[1]))
    static = acts is not None and not acts.get("dynamic") and acts.get("strategy") == "tensor" and block is None
    # a block's activations in groups of its width, as the block-scaled GEMM quantizes them
    grouped = (
        acts is not None
        and block is not None
        and acts.get("dynamic")
        and acts.get("strategy") == "group"
        and acts.get("group_size") == block[1]
    )
    per_token = acts is not None and acts.get("dynamic") and acts.get("strategy") in ("token", None)
    if acts is not None and not (static or grouped or per_token):
        raise QuantizationError(
            f"compressed-tensors group {name!r}: input activations {acts.get('strategy')!r} "
            f"(dynamic={acts.get('dynamic')}, group_size={acts.get('group_size')}) over {strategy} weights are "
            "not supported; only dynamic per-token scales, static per-tensor ones over channel or tensor weights, "
            "or dynamic groups of a block's width over block weights"
        )
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise QuantizationError(f"compressed-tensors group {name!r} targets {targets}; only ['Linear'] is supported")
    return Fp8Scheme(
        block=block,
        ignore=tuple(qc.get("ignore") or ()),
        ignore_style="compressed-tensors",
        static_activations=static,
    )
