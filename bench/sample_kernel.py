"""The sampler's kernels (worker/triton_ops.py: sample_rows, the Gumbel-max draw of each row at temperature
0.6 over Qwen3's vocabulary of 151,936, bf16 logits as the LM head writes them) at batches 256, 64 and 1:
median microseconds a call in a CUDA graph for each (vocabulary a program, warps), the default first, and
whether each picks the default's tokens.

    python bench/sample_kernel.py [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_graph  # noqa: E402

from worker import triton_ops  # noqa: E402

VOCAB = 151936
TILES = [(None, None), (1024, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (1024, 2), (2048, 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64, 1])
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for batch in args.batch:
        g = torch.Generator(device="cuda").manual_seed(batch)
        logits = (torch.randn(batch, VOCAB, generator=g, device="cuda") * 2).to(torch.bfloat16)
        temperature = torch.full((batch,), 0.6, device="cuda")
        seeds = torch.arange(batch, dtype=torch.int64, device="cuda")
        positions = torch.full((batch,), 700, dtype=torch.int64, device="cuda")
        out = torch.empty(batch, dtype=torch.int32, device="cuda")
        want = None
        for block, warps in TILES:
            tile = {} if block is None else {"block": block, "num_warps": warps}

            def draw():
                triton_ops.sample_rows(logits, temperature, seeds, positions, out=out, **tile)

            us = time_graph(draw, reps=50, calls=10)
            draw()
            torch.cuda.synchronize()
            tokens = out.tolist()
            want = tokens if want is None else want
            row = {
                "batch": batch,
                "block": block or triton_ops._SAMPLE_BLOCK,
                "num_warps": warps or triton_ops._SAMPLE_WARPS,
                "default": block is None,
                "us": us,
                "logits_tb_s": logits.numel() * 2 / us / 1e6,
                "same_tokens": tokens == want,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'batch':>5} {'block':>6} {'warps':>5} {'us':>8} {'TB/s':>6} same")
    for r in results:
        mark = " (default)" if r["default"] else ""
        print(
            f"{r['batch']:>5} {r['block']:>6} {r['num_warps']:>5} {r['us']:>8.2f} {r['logits_tb_s']:>6.2f}"
            f" {r['same_tokens']}{mark}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
