"""GGUF checkpoints: a `.gguf` file becomes, once, a Hugging Face folder the rest of the engine reads as any other
(config.json with the architecture, the tokenizer and chat template from the file's metadata, the weights
dequantized to float32 safetensors), through transformers' GGUF support and the `gguf` package."""

from __future__ import annotations

import hashlib
import logging
import shutil
import struct
import tempfile
from pathlib import Path

from worker.cache_home import cache_home
from worker.checkpoint_error import CheckpointError

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
CACHE = cache_home() / "gguf"


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(SUFFIX) and Path(model).is_file()


def folder_for(gguf_file: Path, cache: Path = CACHE) -> Path:
    """Where the folder made from this file lives, named by the file's contents (its size and first MiB, where
    GGUF keeps its metadata), not its path: a copy on another node names the same folder."""
    digest = hashlib.sha256(str(gguf_file.stat().st_size).encode())
    with open(gguf_file, "rb") as f:
        digest.update(f.read(1 << 20))
    return cache / f"{gguf_file.stem}-{digest.hexdigest()[:16]}"


def gguf_folder(model: str | Path, cache: Path = CACHE) -> Path:
    """The Hugging Face folder made from the GGUF file `model`, made now if it is not there yet. Host memory
    while making it: the dequantized weights, and their serialization."""
    gguf_file = Path(model)
    folder = folder_for(gguf_file, cache)
    if (folder / "model.safetensors").exists():  # written last, then the folder renamed: a whole one
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    logger.warning("converting %s to a Hugging Face folder in %s (once)", gguf_file, folder)
    work = Path(tempfile.mkdtemp(prefix=".making-", dir=cache))
    try:
        _convert(gguf_file, work)
        try:
            work.rename(folder)
        except OSError:  # another process made it meanwhile
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _convert(gguf_file: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from worker.models import MODELS, SERVED_ARCHITECTURES

    where, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
    # an architecture transformers cannot read, a damaged file (struct.error: one cut inside its metadata)
    except (ValueError, KeyError, OSError, struct.error) as e:
        raise CheckpointError(f"{gguf_file} cannot be read as a GGUF checkpoint: {e}") from e
    _mixture_as_llama_cpp_runs_it(gguf_file, config)
    with torch.device("meta"):  # the names only: transformers maps the file's tensors onto this model's
        hf_model = AutoModelForCausalLM.from_config(config)
    arch = type(hf_model).__name__
    if arch not in MODELS:
        runs = ", ".join(SERVED_ARCHITECTURES)
        raise CheckpointError(f"{gguf_file} holds a {arch}, which this server does not run; it runs {runs}")
    # before the weights, which take minutes and the whole model's float32 in memory to dequantize
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, OSError) as e:  # no tokenizer in its metadata, or one transformers cannot build
        raise CheckpointError(f"{gguf_file}: its tokenizer cannot be read: {e}") from e
    try:
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=hf_model)["tensors"]
    # a quantization type the gguf package cannot undo, a file cut inside its tensors
    except (ValueError, NotImplementedError, KeyError, struct.error) as e:
        raise CheckpointError(f"{gguf_file}: its weights cannot be dequantized: {e}") from e
    config.architectures = [arch]
    config.dtype = "bfloat16"  # what a GPU serves it in by default (the CPU serves float32)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))


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


def _mixture_as_llama_cpp_runs_it(gguf_file: Path, config) -> None:
    """Sets a mixture of experts' widths from the file's metadata and its routing as llama.cpp (the format's
    reference) runs it, where transformers' GGUF config leaves them at its defaults; a mixture under another
    architecture (Mixtral's, written as llama's) is a CheckpointError."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    experts = reader.fields.get(f"{arch}.expert_count")
    if arch not in _MIXTURE_WIDTHS and experts is not None and int(experts.contents()) > 0:
        # transformers reads such a file as its dense architecture and drops the experts
        raise CheckpointError(
            f"{gguf_file} holds a mixture of {int(experts.contents())} experts under GGUF architecture {arch!r} "
            f"(llama.cpp's layout of Mixtral), which is not read from GGUF here; serve its Hugging Face folder, or "
            f"a GGUF of {', '.join(_MIXTURE_WIDTHS)}"
        )
    for key, field, fallback in _MIXTURE_WIDTHS.get(arch, ()):
        found = reader.fields.get(f"{arch}.{key}")
        setattr(config, field, int(found.contents()) if found is not None else fallback(config))
    for field, value in _MIXTURE_RUN.get(arch, {}).items():
        setattr(config, field, value)


if __name__ == "__main__":  # make the folder on a node ahead of serving: python -m worker.gguf FILE.gguf
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m worker.gguf FILE.gguf (prints the model folder made from it)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(gguf_folder(sys.argv[1]))
    except (CheckpointError, OSError) as e:
        sys.exit(f"worker.gguf: {e}")
