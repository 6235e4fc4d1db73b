"""GGUF checkpoints: a `.gguf` file becomes, once, a Hugging Face folder the rest of the engine reads as any other
(config.json with the architecture, the tokenizer and chat template from the file's metadata through transformers'
GGUF support; the weights dequantized a tensor at a time through the `gguf` package, worker/gguf_tensors.py, and
written in safetensors shards as they come)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.cache_home import cache_home
from worker.checkpoint_error import CheckpointError

if TYPE_CHECKING:  # launch.py imports this module: torch and numpy only once a file is converted
    import torch

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
CACHE = cache_home() / "gguf"
INDEX = "model.safetensors.index.json"
# the conversion's version, in its folders' names: 2 reads Llama 3's rotary scaling, Qwen3's head width and no
# attention window a file lacks, which 1 (transformers' reading) left out
CONVERSION = 2
# the dequantized weights a shard file holds: what the conversion keeps in host memory at once
SHARD_BYTES = 1 << 30
# a file that takes long enough to convert to show its progress (the tests' tiny ones do not)
PROGRESS_BYTES = 64 << 20


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(SUFFIX) and Path(model).is_file()


def folder_for(gguf_file: Path, cache: Path = CACHE, conversion: int | None = None) -> Path:
    """Where the folder made from this file lives, named by the file's contents (its size and first MiB, where
    GGUF keeps its metadata), not its path: a copy on another node names the same folder; and by the conversion
    that makes it (CONVERSION; 1 named none), so a folder an older one made is not read."""
    conversion = CONVERSION if conversion is None else conversion
    digest = hashlib.sha256(str(gguf_file.stat().st_size).encode())
    with open(gguf_file, "rb") as f:
        digest.update(f.read(1 << 20))
    if conversion > 1:
        digest.update(f"conversion {conversion}".encode())
    return cache / f"{gguf_file.stem}-{digest.hexdigest()[:16]}"


def gguf_folder(model: str | Path, cache: Path = CACHE) -> Path:
    """The Hugging Face folder made from the GGUF file `model`, made now if it is not there yet. Host memory
    while making it: a shard of the dequantized weights (SHARD_BYTES) and the tensor being read."""
    gguf_file = first_part(Path(model))
    folder = folder_for(gguf_file, cache)
    if _whole(folder):
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    for older in range(1, CONVERSION):
        if _whole(stale := folder_for(gguf_file, cache, older)):
            logger.warning("%s, an older conversion of this file, is no longer read: remove it to free its disk", stale)
    work = Path(tempfile.mkdtemp(prefix=".making-", dir=cache))
    try:
        try:
            _convert(gguf_file, work, folder)
        except CheckpointError as e:
            raise CheckpointError(f"{gguf_file}: {e}") from e
        try:
            work.rename(folder)
        except OSError:  # another process made it meanwhile
            if not _whole(folder):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


# a model llama.cpp's gguf-split wrote in parts: NAME-00001-of-00003.gguf, ...; the first holds the metadata
_PART = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def first_part(gguf_file: Path) -> Path:
    """The file a model's folder is made from: its first part where it is one of several (by the parts' names)."""
    found = _PART.fullmatch(gguf_file.name)
    if found is None or int(found["no"]) == 1:
        return gguf_file
    return gguf_file.with_name(f"{found['stem']}-00001-of-{found['count']}.gguf")


def model_name(gguf_file: Path) -> str:
    """The name a file serves under: its own, less a part's -00001-of-00003."""
    found = _PART.fullmatch(gguf_file.name)
    return found["stem"] if found else gguf_file.stem


@dataclass(frozen=True)
class _Model:
    """A GGUF model read across its parts: the first's metadata, every part's tensors (memory-mapped)."""

    fields: dict
    tensors: list


def _open(first: Path):
    """The GGUFReader of a file, or its parts' together where its metadata says it is the first of several."""
    import gguf

    reader = gguf.GGUFReader(str(first))
    count = int(_field(reader, "split.count") or 1)
    if count == 1:
        return reader
    found = _PART.fullmatch(first.name)
    if found is None or int(found["count"]) != count:
        named = f"NAME-00001-of-{count:05d}.gguf"
        raise CheckpointError(f"it is the first of {count} parts, but its name is not llama.cpp's {named}")
    tensors = list(reader.tensors)
    for no in range(2, count + 1):
        part = first.with_name(f"{found['stem']}-{no:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise CheckpointError(f"its part {part.name} is not beside it")
        tensors += gguf.GGUFReader(str(part)).tensors
    return _Model(reader.fields, tensors)


def _whole(folder: Path) -> bool:
    # the weights are written last, then the folder renamed into place: a folder there is a whole one
    return (folder / "model.safetensors").exists() or (folder / INDEX).exists()


def _cut_short(e: Exception) -> bool:
    """Whether opening the file failed where it ended before the data its metadata describes: numpy cannot
    shape a tensor's mapped bytes (fewer are left), or struct finds fewer bytes than a field needs."""
    return isinstance(e, struct.error) or (isinstance(e, ValueError) and "cannot reshape" in str(e))


def _unreadable(gguf_file: Path, e: Exception) -> CheckpointError:
    if _cut_short(e):
        size = gguf_file.stat().st_size
        return CheckpointError(
            f"it ends before the data its header describes ({size:,} bytes): the file is cut short; download it again"
        )
    return CheckpointError(f"it cannot be read as a GGUF checkpoint: {e}")


def _convert(gguf_file: Path, out: Path, folder: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from worker.gguf_tensors import Heads, hf_tensors
    from worker.models import MODELS, SERVED_ARCHITECTURES

    where, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        reader = _open(gguf_file)  # the tensors memory-mapped, read as they are converted
    # an architecture transformers cannot read, a damaged file (struct.error: one cut inside its metadata)
    except (ValueError, KeyError, OSError, struct.error) as e:
        raise _unreadable(gguf_file, e) from e
    gguf_arch = _field(reader, "general.architecture")
    config = _as_llama_cpp_runs_it(reader, gguf_arch, config)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch not in MODELS:
        runs = ", ".join(SERVED_ARCHITECTURES)
        what = arch or config.model_type
        raise CheckpointError(f"it holds a {what}, which this server does not run; it runs {runs}")
    # before the weights, which take minutes to dequantize
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, OSError) as e:  # no tokenizer in its metadata, or one transformers cannot build
        raise CheckpointError(f"its tokenizer cannot be read: {e}") from e
    # said once the file is known to be readable, before the minutes of dequantizing
    logger.warning("converting %s to a Hugging Face folder in %s (once)", gguf_file, folder)
    # llama.cpp reorders the rotary rows of q and k in llama's files (Mixtral's among them), not in Qwen's
    permuted = Heads(config.num_attention_heads, config.num_key_value_heads) if gguf_arch == "llama" else None
    try:
        size = sum(int(t.n_bytes) for t in reader.tensors)
        with tqdm(total=size, desc="dequantizing", unit="B", unit_scale=True, disable=size < PROGRESS_BYTES) as bar:
            write_shards(hf_tensors(reader, permuted, bar.update), out)
    except (ValueError, struct.error) as e:  # (a file cut short fails earlier, as its tensors are mapped)
        raise CheckpointError(f"its weights cannot be read: {e}") from e
    config.architectures = [arch]
    config.dtype = "bfloat16"  # what a GPU serves it in by default (the CPU serves float32)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int | None = None) -> None:
    """Writes the named tensors as they come, a safetensors file each `shard_bytes` (SHARD_BYTES) or so, with the
    index that names each tensor's file; one file is model.safetensors, without an index."""
    from safetensors.torch import save_file

    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes

    files: list[Path] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal size
        path = out / f"model-{len(files) + 1:05d}.safetensors"
        save_file(pending, str(path))
        weight_map.update(dict.fromkeys(pending, path.name))
        files.append(path)
        pending.clear()
        size = 0

    for name, tensor in tensors:
        if name in pending or name in weight_map:
            raise CheckpointError(f"it holds {name} twice")
        pending[name] = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        size, total = size + nbytes, total + nbytes
        del tensor  # the shard holds it, until written
        if size >= shard_bytes:
            flush()
    if pending or not files:
        flush()
    if len(files) == 1:
        files[0].rename(out / "model.safetensors")
        return
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _field(reader, key: str):
    found = reader.fields.get(key)
    return found.contents() if found is not None else None


# A mixture's widths that transformers' GGUF config leaves at its class's defaults (Qwen3-30B-A3B's, Qwen1.5-MoE's),
# by GGUF architecture: (metadata key, config field, llama.cpp's width where the key is absent)
_EXPERT_WIDTH = (
    "expert_feed_forward_length",
    "moe_intermediate_size",
    lambda c: c.intermediate_size // c.num_experts_per_tok,
)
_MIXTURE_WIDTHS = {
    "qwen3moe": (_EXPERT_WIDTH,),
    "qwen2moe": (
        _EXPERT_WIDTH,
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", lambda c: c.intermediate_size),
    ),
}
# and how llama.cpp runs those architectures: every layer sparse, the top-k weights renormalised by qwen3moe only
_MIXTURE_RUN = {
    "qwen3moe": {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2moe": {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}


def _as_llama_cpp_runs_it(reader, gguf_arch: str | None, config):
    """The config transformers reads from the file, made to run as llama.cpp (the format's reference) runs it: the
    head width, the attention window, a mixture's widths and its routing from the file's metadata, where
    transformers leaves them at its defaults (a file named "mistral" gets Mistral's class default window of 4,096);
    llama's architecture with experts (llama.cpp's Mixtral, which transformers reads as a dense Llama) a
    Mixtral."""
    experts = _field(reader, f"{gguf_arch}.expert_count")
    if experts and gguf_arch != "llama" and gguf_arch not in _MIXTURE_WIDTHS:
        raise CheckpointError(
            f"it holds a mixture of {int(experts)} experts under GGUF architecture {gguf_arch!r}, which is not read "
            f"from GGUF here; serve its Hugging Face folder, or a GGUF of llama (Mixtral), {', '.join(_MIXTURE_WIDTHS)}"
        )
    head_dim = _field(reader, f"{gguf_arch}.attention.key_length")
    if head_dim is not None:  # transformers reads it for some architectures only (not qwen3's 128 over 16 heads)
        config.head_dim = int(head_dim)
    _read_rope_scaling(reader, config)
    if hasattr(config, "sliding_window"):  # a window is in the file, or llama.cpp attends the whole sequence
        window = _field(reader, f"{gguf_arch}.attention.sliding_window")
        config.sliding_window = int(window) if window else None
    if gguf_arch == "llama" and experts:
        return _mixtral(config, int(experts), int(_field(reader, "llama.expert_used_count") or 2))
    for key, field, fallback in _MIXTURE_WIDTHS.get(gguf_arch, ()):
        found = _field(reader, f"{gguf_arch}.{key}")
        setattr(config, field, int(found) if found is not None else fallback(config))
    for field, value in _MIXTURE_RUN.get(gguf_arch, {}).items():
        setattr(config, field, value)
    return config


def _read_rope_scaling(reader, config) -> None:
    """Llama 3's rotary scaling, which llama.cpp keeps as a tensor of factors (worker/gguf_rope.py)."""
    from worker.gguf_rope import llama3_rope
    from worker.gguf_tensors import ROPE_FACTORS, dequantize
    from worker.layers.rotary import rope_parameters

    factors = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    if factors is None:
        return
    theta = rope_parameters(config)["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = llama3_rope(dequantize(factors), theta, head_dim)
    if params is None:
        return
    if hasattr(config, "rope_parameters"):  # transformers 5
        config.rope_parameters = {**params, "rope_theta": theta}
    else:
        config.rope_scaling = params


def _mixtral(llama, experts: int, top_k: int):
    """Mixtral's config from the Llama one transformers reads (the expert width is llama.cpp's
    feed_forward_length, which it reads as intermediate_size)."""
    import inspect

    from transformers import MixtralConfig

    from worker.layers.rotary import rope_parameters

    takes = inspect.signature(MixtralConfig.__init__).parameters
    fields = {k: v for k, v in llama.to_dict().items() if k in takes and k not in ("architectures", "dtype")}
    mixtral = MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=top_k)
    if rope_parameters(mixtral) != rope_parameters(llama):  # a rotary scaling this transformers' Mixtral cannot hold
        raise CheckpointError(f"its rotary embedding {rope_parameters(llama)} does not carry over to Mixtral's config")
    return mixtral


if __name__ == "__main__":  # make the folder on a node ahead of serving: python -m worker.gguf FILE.gguf
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m worker.gguf FILE.gguf (prints the model folder made from it)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(gguf_folder(sys.argv[1]))
    except (CheckpointError, OSError) as e:
        sys.exit(f"worker.gguf: {e}")
