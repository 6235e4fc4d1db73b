"""How much of a batch-1 decode step's GEMVs programmatic dependent launch (PDL) saves, by how many of each
GEMV's programs prefetch their weight rows into L2 before they wait on the kernel before. A model's
dense layers (qkv, o, gate-up with SiLU in the epilogue, down; distinct weights for every layer, so L2
holds none across layers) replayed in one CUDA graph: without PDL, and with it by the default rule
(triton_ops.prefetch_programs), while all programs prefetch, the first 8, 4, 2 and 1 a multiprocessor, or
none. Median microseconds a
layer, each variant timed in two rounds (alternated).

    python bench/pdl_prefetch.py [--arch qwen3-8b] [--fp8] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import ARCHS, time_graph  # noqa: E402

from worker import gemv, triton_ops  # noqa: E402
from worker.quant import gemm  # noqa: E402

PROGRAMS_PER_SM = (8, 4, 2, 1, 0)


def layer_shapes(arch: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of a decoder layer's linears; gate-up's N counts both halves."""
    hidden, inter, head = arch["hidden_size"], arch["intermediate_size"], arch.get("head_dim", 128)
    qkv = (arch["num_attention_heads"] + 2 * arch["num_key_value_heads"]) * head
    return {
        "qkv": (hidden, qkv),
        "o": (arch["num_attention_heads"] * head, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-8b")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights with per-channel scales")
    parser.add_argument("--layers", type=int, help="default: the architecture's")
    parser.add_argument("--out")
    args = parser.parse_args()
    arch = ARCHS[args.arch]
    layers = args.layers or arch["num_hidden_layers"]
    shapes = layer_shapes(arch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = []
    for _ in range(layers):
        layer = {}
        for name, (k, n) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            if args.fp8:
                layer[name] = (w.to(torch.float8_e4m3fn), torch.rand(n, 1, device="cuda") * 0.01 + 0.005)
            else:
                layer[name] = (w, None)
        weights.append(layer)
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes.values()}

    def linear(name: str, w: torch.Tensor, scale: torch.Tensor | None, pdl: bool, programs: int | None):
        x = xs[shapes[name][0]]
        gated = name == "gate_up"
        if scale is None:
            return gemv.small_linear(x, w, pdl=pdl, gated=gated, prefetch_programs=programs)
        return gemm.fp8_gemv(x, w, scale, None, pdl=pdl, gated=gated, prefetch_programs=programs)

    def step(pdl: bool, programs: int | None):
        for layer in weights:
            for name, (w, scale) in layer.items():
                linear(name, w, scale, pdl, programs)

    variants = {"off": (False, None), "default": (True, None), "all": (True, triton_ops.PDL_PREFETCH_ALL)}
    variants.update({f"{p}_per_sm": (True, p * sms) for p in PROGRAMS_PER_SM})
    reference = [linear(n, w, s, False, None) for n, (w, s) in weights[0].items()]
    for pdl, programs in variants.values():
        got = [linear(n, w, s, pdl, programs) for n, (w, s) in weights[0].items()]
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, (pdl, programs) in variants.items():
            times[name].append(time_graph(lambda: step(pdl, programs)) / layers)
    result = {
        "arch": args.arch,
        "fp8": args.fp8,
        "layers": layers,
        "sms": sms,
        "device": torch.cuda.get_device_name(),
        "us_per_layer": times,
        "vs_off": {name: min(t) / min(times["off"]) for name, t in times.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
