"""Tiny FP8 checkpoints in the published formats, made from a tiny float32 one: transformers'
`quant_method: "fp8"` (e4m3 weights, float32 `weight_scale_inv` per [128, 128] block: the Qwen3 FP8
releases), compressed-tensors' FP8 (e4m3 weights, bf16 `weight_scale` per output channel, dynamic
per-token activations: the `*-FP8-dynamic` releases; with bf16 `weight_scale` per [128, 128] block, its
FP8_BLOCK preset), and the two static ones, a float32 scale a weight
and a calibrated `input_scale` a linear: compressed-tensors' (llm-compressor's FP8 preset, the `*-FP8`
releases; scales of shape [1]) and AutoFP8's (`quant_method: "fp8"` without `weight_block_size`, scalar
scales). Each comes with its reference: the same folder with the weights dequantized to float32 and no
quantization_config, which transformers runs as is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
STATIC = ("fp8-static", "compressed-tensors-static")  # static activation scales, a scale a weight
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UNQUANTIZED = "model.layers.1.mlp.down_proj"  # each format names it as left in full precision


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale per block [ceil(N/bn), ceil(K/bk)] in scale_dtype) with w ~= e4m3 * scale."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-448, 448).to(FP8).view(rows * bn, cols * bk)[:n, :k]
    return q.contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]
    return q.float() * full


def quantize_channels(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale [N, 1] in scale_dtype) with w ~= e4m3 * scale, each row's amax at 448."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12).to(scale_dtype)
    q = (w.float() / scale.float()).clamp(-448, 448).to(FP8)
    return q, scale


def write_rounded_projections(src: Path, out: Path) -> Path:
    """`src` copied to `out` with every projection rounded per output row to e4m3 (float32 scales) and
    dequantized: the reference of quantization fp8 at load, for transformers to run."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            q, s = quantize_channels(w, torch.float32)
            tensors[name] = q.float() * s
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _quantized(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS and module != UNQUANTIZED


def write_fp8_checkpoint(src: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """The FP8 folder (format `fmt`: "fp8", "compressed-tensors", "compressed-tensors-block" or one of STATIC)
    and its dequantized reference."""
    fp8_dir, ref_dir = out / fmt, out / f"{fmt}-dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    tensors = load_file(str(src / "model.safetensors"))
    quantized, reference = {}, {}
    for name, w in tensors.items():
        if not _quantized(name):
            quantized[name] = reference[name] = w
            continue
        base = name.removesuffix(".weight")
        if fmt == "fp8":
            q, scale = quantize_blocks(w, (128, 128))
            quantized[f"{base}.weight_scale_inv"] = scale
            reference[name] = dequantize_blocks(q, scale, (128, 128))
        elif fmt == "compressed-tensors-block":  # the block's scale named as a channel's, in bf16
            q, scale = quantize_blocks(w, (128, 128), torch.bfloat16)
            quantized[f"{base}.weight_scale"] = scale
            reference[name] = dequantize_blocks(q, scale, (128, 128))
        elif fmt in STATIC:  # one scale for the whole weight, and a calibrated one for its input
            scale = (w.float().abs().max() / 448.0).clamp(min=1e-12)
            q = (w.float() / scale).clamp(-448, 448).to(FP8)
            shape = () if fmt == "fp8-static" else (1,)
            quantized[f"{base}.weight_scale"] = scale.reshape(shape)
            quantized[f"{base}.input_scale"] = torch.tensor(0.05).reshape(shape)
            reference[name] = q.float() * scale
        else:
            q, scale = quantize_channels(w)
            quantized[f"{base}.weight_scale"] = scale
            reference[name] = q.float() * scale.float()
        quantized[name] = q
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, ref_dir


def quantization_config(fmt: str) -> dict:
    """config.json's quantization_config as each format's tools write it."""
    if fmt == "fp8":  # transformers' FineGrainedFP8Config
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", UNQUANTIZED],
        }
    if fmt == "fp8-static":  # AutoFP8's
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", UNQUANTIZED]}
    act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    if fmt == "compressed-tensors-static":  # llm-compressor's FP8 preset
        act, weights = {**act, "strategy": "tensor", "dynamic": False}, {**weights, "strategy": "tensor"}
    if fmt == "compressed-tensors-block":  # its FP8_BLOCK preset
        act = {**act, "strategy": "group", "group_size": 128}
        weights = {**weights, "strategy": "block", "block_structure": [128, 128]}
    return {  # llm-compressor's FP8_DYNAMIC preset (or FP8, FP8_BLOCK), saved by compressed-tensors
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "observer": "minmax"},
                "input_activations": {**act, "observer": None},
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
        "kv_cache_scheme": None,
    }
