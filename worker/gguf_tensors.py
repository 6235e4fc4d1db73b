"""A GGUF file's tensors under the Hugging Face names this engine loads, dequantized one at a time as they are read
(the file itself is memory-mapped), so making a model's folder never holds more than a tensor or two of it.
llama.cpp's names for the architectures served: llama (Mixtral too, as llama with experts), qwen2, qwen3,
qwen2moe, qwen3moe."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from worker.checkpoint_error import CheckpointError

# a file's own float formats are kept as they are (exact); a quantized one's values are float32, as
# dequantized (an int8 times a float16 scale is not always a float16 or a bfloat16)
_KEPT = {"F16": torch.float16, "BF16": torch.bfloat16}

_MODEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# a layer's tensor (blk.{i}.NAME.weight or .bias) -> its module under model.layers.{i}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# a layer's experts stacked a projection ([experts, out, in]): gate and up become one gate_up_proj, gate first
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1}
# llama.cpp's older Mixtral files: a tensor an expert (blk.{i}.ffn_gate.{e}.weight), Mixtral's own names
_PER_EXPERT = {"ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}
# llama 3's rotary scaling, which llama.cpp keeps as a tensor: read into the config (worker/gguf_rope.py)
ROPE_FACTORS = "rope_freqs.weight"

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)")


@dataclass(frozen=True)
class Heads:
    """What reversing llama.cpp's rotary permutation of a llama file's q and k rows needs."""

    attention: int
    key_value: int


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's rows of q and k (weights and biases) from rotating halves into
    interleaved pairs (its own rotary kernel's order); this puts them back."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def hf_tensors(
    reader, permuted: Heads | None, progress: Callable[[int], object] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for each of the GGUFReader's tensors, a layer's stacked gate and up given as one
    gate_up_proj once both are read. `permuted`: the file is llama's, its q and k rows to be put back; `progress`:
    told the bytes of each of the file's tensors as it is read. Nothing is kept once given (the consumer decides
    how long a tensor lives) but the half of a layer's experts read first."""
    halves: dict[str, _GateUp] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if progress is not None:
            progress(int(tensor.n_bytes))
        if name == ROPE_FACTORS:
            continue
        if name in _MODEL:
            yield _MODEL[name], read(tensor)
            continue
        found = _BLOCK.fullmatch(name)
        if found is None:
            raise CheckpointError(f"it holds a tensor {name!r}, which no model served here has")
        layer, part, expert, suffix = found.groups()
        prefix = f"model.layers.{layer}"
        if expert is not None and part in _PER_EXPERT:
            yield f"{prefix}.block_sparse_moe.experts.{expert}.{_PER_EXPERT[part]}.{suffix}", read(tensor)
        elif part in _STACKED:
            if prefix not in halves:
                halves[prefix] = _GateUp(_shape(tensor))
            halves[prefix].read(tensor, _STACKED[part])
            if halves[prefix].whole():
                yield f"{prefix}.mlp.experts.gate_up_proj", halves.pop(prefix).joined()
        elif part == "ffn_down_exps":
            yield f"{prefix}.mlp.experts.down_proj", read(tensor)
        elif part in _LAYER and expert is None:
            heads = None
            if permuted is not None and part in ("attn_q", "attn_k"):
                heads = permuted.attention if part == "attn_q" else permuted.key_value
            # the shared expert's gate: a linear of one output, which llama.cpp keeps as a vector
            yield f"{prefix}.{_LAYER[part]}.{suffix}", read(tensor, heads, as_row=part == "ffn_gate_inp_shexp")
        else:
            raise CheckpointError(f"it holds a tensor {name!r}, which no model served here has")
    if halves:
        layers = ", ".join(sorted(halves))
        raise CheckpointError(f"its experts' gate or up projection is missing from {layers}")


def read(tensor, heads: int | None = None, as_row: bool = False) -> torch.Tensor:
    """The tensor's values: float16 and bfloat16 as they are (exact), any other type dequantized to float32; rows
    put back from llama.cpp's rotary order (`heads`), or a vector made one row."""
    kind, shape = tensor.tensor_type.name, _shape(tensor)
    if kind == "F16":
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float16)).reshape(shape)
    elif kind == "BF16":  # the reader gives its bytes
        out = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    else:
        out = torch.from_numpy(dequantize(tensor))
    if heads is not None:
        out = unpermute(out, heads).contiguous()
    return out.reshape(1, -1) if as_row else out


class _GateUp:
    """A layer's stacked gate and up projections ([experts, intermediate, hidden] each) read into one
    [experts, 2 x intermediate, hidden] array, gate first, as they come."""

    def __init__(self, half: tuple[int, ...]) -> None:
        self.half = half
        self.values = np.empty((half[0], 2 * half[1], *half[2:]), dtype=np.float32)
        self.kinds: list[str | None] = [None, None]

    def read(self, tensor, which: int) -> None:
        if _shape(tensor) != self.half:
            shape, other = list(_shape(tensor)), list(self.half)
            raise CheckpointError(f"its tensor {tensor.name} is {shape}, the other half of its experts {other}")
        width = self.half[1]
        dequantize(tensor, self.values[:, which * width : (which + 1) * width])
        self.kinds[which] = tensor.tensor_type.name

    def whole(self) -> bool:
        return None not in self.kinds

    def joined(self) -> torch.Tensor:
        out = torch.from_numpy(self.values)
        kind = self.kinds[0] if self.kinds[0] == self.kinds[1] else None
        return out.to(_KEPT[kind]) if kind in _KEPT else out


# elements dequantized at a time: the dequantizer's temporaries stay a few times this, not a few times the tensor
CHUNK = 1 << 22


def _shape(tensor) -> tuple[int, ...]:
    return tuple(reversed(tensor.shape.tolist()))  # GGUF lists a tensor's dimensions innermost first


def dequantize(tensor, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor's values as float32, into `out` (of its shape) or a new array, a few rows at a time."""
    if out is None:
        out = np.empty(_shape(tensor), dtype=np.float32)
    if out.size:
        _rows(tensor, tensor.data, out)
    return out


def _rows(tensor, data: np.ndarray, out: np.ndarray) -> None:
    if out.ndim > 2:  # an expert (or a leading index) at a time
        for i in range(len(out)):
            _rows(tensor, data[i], out[i])
        return
    if out.ndim < 2:  # a vector whole: a quantized one's bytes do not split by element
        out[...] = _dequantized(tensor, data).reshape(out.shape)
        return
    step = max(1, CHUNK // out.shape[1])
    for start in range(0, len(out), step):
        rows = out[start : start + step]
        rows[...] = _dequantized(tensor, data[start : start + step]).reshape(rows.shape)


def _dequantized(tensor, data: np.ndarray) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError as e:
        kind = tensor.tensor_type.name
        raise CheckpointError(f"its tensor {tensor.name} is {kind}, which cannot be dequantized here: {e}") from e
