"""The host memory an engine takes to load a checkpoint on the CPU, unquantized and with `quantization: fp8`:
a checkpoint of the architecture's shapes with random bf16 weights is written once (safetensors, a
word-level tokenizer), then each engine starts in a process of its own and reports the peak of its
anonymous resident memory while it starts (its tensors; the checkpoint's mapped pages left out) beside
the bytes of its weights. Quantization at load that held the whole model in the
model's dtype first peaks above the unquantized model; one that quantizes each linear as it is read peaks
near the FP8 model.

    python bench/quantized_load_memory.py [--arch qwen3-0.6b] [--dtype bfloat16] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python bench/x.py` from anywhere

from common import model_folder  # noqa: E402
from host_memory import PeakAnonMemory  # noqa: E402


def write_checkpoint(arch: str) -> str:
    """model_folder's config and tokenizer, and random bf16 weights of every tensor transformers names."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(model_folder(arch, with_tokenizer=True))
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight")
        else (torch.rand(shape, generator=gen) * 0.04 - 0.02).to(torch.bfloat16)
        for name, shape in shapes.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def measure(folder: str, dtype: str, quantization: str | None) -> dict:
    """One engine started in this process: its peak anonymous memory while it started (sampled every
    millisecond: the tensors it made, not the checkpoint file's pages it read), beside its weights' bytes."""
    from cluster import LLM

    with PeakAnonMemory() as memory:
        llm = LLM(folder, dtype=dtype, quantization=quantization, page_size=16)
    try:
        weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in llm.engine.model.buffers())
    finally:
        llm.shutdown()
    return {
        "quantization": quantization,
        "peak_start_mb": memory.peak_mb,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights_mb": weights / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out")
    parser.add_argument("--measure", nargs=2, metavar=("FOLDER", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child: one engine
        folder, quantization = args.measure
        print(json.dumps(measure(folder, args.dtype, None if quantization == "none" else quantization)))
        return
    folder = write_checkpoint(args.arch)
    checkpoint_mb = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
    rows = []
    for quantization in ("none", "fp8"):
        out = subprocess.run(
            [sys.executable, __file__, "--dtype", args.dtype, "--measure", folder, quantization],
            capture_output=True,
            text=True,
            check=True,
            cwd=tempfile.gettempdir(),
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    result = {"arch": args.arch, "dtype": args.dtype, "checkpoint_mb": checkpoint_mb, "runs": rows}
    for r in rows:
        print(
            f"{r['quantization'] or 'none':>5}: peak while starting {r['peak_start_mb']:8.1f} MB above the process "
            f"before it (ru_maxrss {r['peak_rss_mb']:.1f} MB), weights {r['weights_mb']:8.1f} MB"
        )
    print(f"checkpoint {checkpoint_mb:.1f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
