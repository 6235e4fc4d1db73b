"""Loading a Hugging Face checkpoint folder (config.json plus one or many *.safetensors) into a model,
each parameter's weight_loader keeping this rank's shard; or random weights of the right shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from worker.checkpoint_error import CheckpointError, check_shape


class LazyTensor:
    """A checkpoint tensor read only in the slices a weight loader asks for, so a tensor-parallel rank
    reads its shard, not the whole tensor."""

    def __init__(self, tensor_slice) -> None:
        self._slice = tensor_slice
        self.shape = tuple(tensor_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, index) -> torch.Tensor:
        if index == slice(None) and not self.shape:
            index = ()  # `t[:]`, the whole tensor, of a 0-dim one (a per-tensor scale), which a slice cannot index
        return self._slice[index]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir}")
    return files


def load_weights(model: nn.Module, model_dir: Path, progress: bool = True) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    # a model may load checkpoint tensors into buffers (an index map), may do without some (`optional`)
    # and may not use others (`ignored`)
    buffers = dict(model.named_buffers())
    params.update({name: buffers[name] for name in getattr(model, "checkpoint_buffers", ())})
    optional, ignored = set(getattr(model, "optional", ())), set(getattr(model, "ignored", ()))
    packed = getattr(model, "packed", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected = {name for name in params if not (tied and name == "lm_head.weight") and name not in optional}
    loaded: set[tuple[str, object]] = set()
    files = safetensors_files(model_dir)
    # a model may name parameters to load before any other (`load_first`: the norms that fold into linears
    # quantized as they load, worker/quant/loading.py), wherever the checkpoint keeps them
    first = set(getattr(model, "load_first", ()))
    passes = [(path, True) for path in files] if first else []
    passes += [(path, False) for path in files]
    for path, first_pass in tqdm(passes, desc="loading weights", unit="file", disable=not progress or len(files) < 2):
        try:
            with safe_open(str(path), framework="pt") as f:
                for ckpt_name in f.keys():
                    target = _target_of(ckpt_name, packed)
                    if target is None or ckpt_name in ignored:
                        continue
                    name, shard = target
                    if tied and name == "lm_head.weight":
                        continue
                    if first and (name in first) != first_pass:
                        continue
                    if name not in params:
                        raise CheckpointError(
                            f"{path.name} holds tensor {ckpt_name!r}, which this model has no place for"
                            + _stacked_experts_hint(ckpt_name)
                        )
                    param = params[name]
                    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                    tensor = LazyTensor(f.get_slice(ckpt_name))
                    loader = getattr(owner, "weight_loader", None)
                    try:
                        with torch.no_grad():
                            if shard == STACKED:  # each expert's part in turn, as a published one loads
                                for part_id, part in owner.stacked_parts(tensor):
                                    loader(param, part, part_id)
                                    loaded.add((name, part_id))
                            else:
                                if loader is None:
                                    check_shape(tensor, param.shape, name.rsplit(".", 1)[-1])
                                    param.data.copy_(tensor[:])
                                else:
                                    loader(param, tensor, shard)
                                loaded.add((name, shard))
                    except CheckpointError as e:  # the loaders know the layer; this, the tensor
                        raise CheckpointError(f"{path.name}'s tensor {ckpt_name!r}: {e}") from e
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
    shards_of = {}
    for our_name, shard in packed.values():
        shards_of.setdefault(our_name, set()).add(shard)
    missing = []
    for name in sorted(expected):
        parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        # a stacked parameter (every expert's in one) names the shard ids it is built from
        needed = getattr(owner, "shard_ids", None) or shards_of.get(parent, {0})
        got = {s for n, s in loaded if n == name}
        if not needed <= got:
            missing.append(name)
    if missing:
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )


def _stacked_experts_hint(ckpt_name: str) -> str:
    parts = ckpt_name.split(".")
    if "experts" in parts[:-1] and not parts[parts.index("experts") + 1].isdigit():
        return (
            " (experts are read one tensor each as published, experts.{e}.gate_proj / up_proj / down_proj or "
            "w1 / w3 / w2 with their FP8 scales beside them, or stacked as transformers lays them out, "
            "experts.gate_up_proj and experts.down_proj, unquantized)"
        )
    return ""


# transformers' own layout of a mixture's experts: every expert's projection in one tensor, named as the
# stacked parameter it loads into, less `.weight` (worker/layers/moe/weights.py reads it an expert at a time)
STACKED_EXPERTS = ("gate_up_proj", "down_proj")
STACKED = "stacked"  # the shard id of such a tensor


# an FP8 KV cache's calibrated scales (compressed-tensors' kv_cache_scheme): this server's fp8 cache keeps its
# values unscaled (worker/kv_cache.py) and a half-precision one needs none, so the model is the same without them
KV_CACHE_SCALES = (".k_scale", ".v_scale", ".kv_scale")
# a static FP8 checkpoint's calibrated activation scales: activations here are quantized per token as they run
# (worker/quant/scheme.py, Fp8Scheme.static_activations), so no layer reads one
ACTIVATION_SCALES = (".input_scale",)


def _target_of(ckpt_name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, object] | None:
    """Maps a checkpoint name to (our parameter name, shard id); None for tensors we do not use.

    Each part named in `packed` is replaced by ours (the last one's shard id counts). An expert's index
    (`experts.{e}.`) is dropped from the name, every expert's tensor landing in one stacked parameter,
    and joins the shard id: (e, shard). A tensor stacking every expert's (STACKED_EXPERTS) has the shard id
    STACKED."""
    if "rotary_emb.inv_freq" in ckpt_name:
        return None
    if ckpt_name.endswith(KV_CACHE_SCALES + ACTIVATION_SCALES):
        return None
    parts = ckpt_name.split(".")
    if len(parts) > 1 and parts[-2] == "experts" and parts[-1] in STACKED_EXPERTS:
        ours = [packed.get(part, (part, 0))[0] for part in parts]
        return ".".join([*ours, "weight"]), STACKED
    ours, shard, expert = [], 0, None
    for i, part in enumerate(parts):
        if part.isdigit() and i and parts[i - 1] == "experts":
            expert = int(part)
            continue
        if part in packed:
            part, shard = packed[part]
        ours.append(part)
    return ".".join(ours), shard if expert is None else (expert, shard)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (for benchmarks, where no checkpoint exists): small enough
    that activations stay finite in bf16; norms stay at one."""
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                gen = torch.Generator(device=param.device).manual_seed(seed + i)
                param.uniform_(-0.02, 0.02, generator=gen)
