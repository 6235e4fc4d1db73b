"""The attention prologue (worker/triton_ops.py qkv_prologue: q/k RMSNorm, rotary, the KV-cache write) on
Qwen3-0.6B's shapes in bf16, at a decode batch and a prompt chunk, for each tile (tokens a program, warps):
median microseconds per call over 28 layers' copies replayed in a CUDA graph (distinct buffers, so L2
holds none of them), and the bandwidth reached over the bytes it must move (q, k and v read; q and the
cache's keys and values written).

    python bench/prologue.py [--tokens 1 256 8192] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_graph  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from worker import triton_ops  # noqa: E402
from worker.layers.rotary import RotaryEmbedding  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
TILES = [(1, 1), (1, 2), (1, 4), (4, 4), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    config = Qwen3Config(head_dim=HEAD_DIM, rope_theta=1e6, max_position_embeddings=40960)
    with dev:
        rotary = RotaryEmbedding(config, HEAD_DIM, 40960)
        q_w, k_w = torch.rand(HEAD_DIM) + 0.5, torch.rand(HEAD_DIM) + 0.5
    results = []
    for tokens in args.tokens:
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        qkvs = [torch.randn(tokens, width, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        caches = [
            torch.zeros(2, tokens * 2, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)
        ]
        positions = torch.randint(0, 40000, (tokens,), device=dev)
        out_loc = torch.randperm(tokens * 2, device=dev)[:tokens]
        moved = tokens * (width + HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM) * 2  # bytes a call
        default = triton_ops.prologue_tiles(tokens)
        for block, warps in TILES:

            def run(block=block, warps=warps):
                for qkv, cache in zip(qkvs, caches):
                    triton_ops.qkv_prologue(
                        qkv,
                        positions,
                        out_loc,
                        rotary.cos_sin,
                        q_w,
                        k_w,
                        1e-6,
                        cache[0],
                        cache[1],
                        HEADS,
                        KV_HEADS,
                        HEAD_DIM,
                        block_tokens=block,
                        num_warps=warps,
                    )

            us = time_graph(run, reps=20, calls=1) / LAYERS
            row = {"tokens": tokens, "block_tokens": block, "warps": warps, "us": us, "tb_per_s": moved / us / 1e6}
            row["default"] = (block, warps) == default
            results.append(row)
            mark = "  <- default" if row["default"] else ""
            print(
                f"tokens {tokens:5d}  block {block:3d}  warps {warps}  {us:8.2f} us  {row['tb_per_s']:5.2f} TB/s{mark}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "prologue", "results": results}, indent=2))


if __name__ == "__main__":
    main()
