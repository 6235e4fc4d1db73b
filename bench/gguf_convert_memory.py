"""The host memory a GGUF file's weights take to become a model folder: a GGUF of the architecture's shapes (random
weights, Q8_0 as llama.cpp quantizes, its norms float32) is written once, then each conversion runs in a process
of its own and reports the peak of its anonymous resident memory (its arrays and tensors; the file's mapped pages
left out) and its time: the engine's, a tensor dequantized at a time and written in shards (worker/gguf.py), at
its shard size and a smaller one, against transformers' reading of the whole file (`load_gguf_checkpoint`, every
tensor at once) saved as one file. The metadata (config, tokenizer) is left out: both read it the same way.

    python bench/gguf_convert_memory.py [--arch qwen3-0.6b] [--shard-mb 512] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as `python bench/x.py` from anywhere

from common import model_folder  # noqa: E402
from host_memory import PeakAnonMemory  # noqa: E402


def write_gguf(arch: str, path: Path) -> dict:
    """A GGUF of `arch`'s shapes under llama.cpp's names, its matrices Q8_0; returns the HF config as a dict."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    from worker import gguf_tensors

    config = AutoConfig.from_pretrained(model_folder(arch))
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(config.num_hidden_layers)
    rng = np.random.default_rng(0)
    hf_to_gguf = {hf: ours for ours, hf in gguf_tensors._LAYER.items()}

    def add(name: str, shape: tuple[int, ...]) -> None:
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
            return
        values = (rng.random(shape, dtype=np.float32) * 0.04 - 0.02).reshape(shape)
        writer.add_tensor(
            name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
        )

    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    add("token_embd.weight", (config.vocab_size, hidden))
    add("output_norm.weight", (hidden,))
    if not config.tie_word_embeddings:
        add("output.weight", (config.vocab_size, hidden))
    shapes = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv * head_dim, hidden),
        "self_attn.v_proj": (kv * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "self_attn.q_norm": (head_dim,),
        "self_attn.k_norm": (head_dim,),
        "mlp.gate_proj": (config.intermediate_size, hidden),
        "mlp.up_proj": (config.intermediate_size, hidden),
        "mlp.down_proj": (hidden, config.intermediate_size),
    }
    for layer in range(config.num_hidden_layers):
        for hf, shape in shapes.items():
            add(f"blk.{layer}.{hf_to_gguf[hf]}.weight", shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config.to_dict()


def child(way: str, file: str, out: str, shard_mb: int, config: str) -> None:
    """One conversion in this process; prints its peak anonymous memory above the process before it, and time."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from worker.gguf import write_shards
    from worker.gguf_tensors import hf_tensors

    hf_config = AutoConfig.for_model(**json.loads(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    start = time.perf_counter()
    with PeakAnonMemory() as memory:
        if way == "theirs":
            tensors = load_gguf_checkpoint(file, return_tensors=True, model_to_load=model)["tensors"]
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out) / "model.safetensors"))
        else:
            write_shards(hf_tensors(gguf.GGUFReader(file), None), Path(out), shard_mb << 20)
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_mb": round(memory.peak_mb, 1), "seconds": round(seconds, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the dense ones: the file is written a dense layer at a time
    parser.add_argument("--arch", choices=["qwen3-0.6b", "qwen3-8b"], default="qwen3-0.6b")
    parser.add_argument("--shard-mb", type=int, default=512, help="the smaller shard size measured beside 1,024")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, file, out, shard_mb, config = args.child
        child(way, file, out, int(shard_mb), config)
        return
    results = {"arch": args.arch}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "model.gguf"
        config = write_gguf(args.arch, file)
        results["file_mb"] = round(file.stat().st_size / 2**20, 1)
        for way, shard_mb in (("theirs", 0), ("ours", 1024), ("ours", args.shard_mb)):
            out = Path(tempfile.mkdtemp(dir=tmp))
            command = [sys.executable, __file__, "--child", way, str(file), str(out), str(shard_mb), json.dumps(config)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            figure = json.loads(done.stdout.strip().splitlines()[-1])
            figure["written_mb"] = round(sum(f.stat().st_size for f in out.iterdir()) / 2**20, 1)
            results[way if way == "theirs" else f"ours_{shard_mb}mb"] = figure
            print(way, shard_mb or "", figure, flush=True)
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
