"""The FP8-weight linear layers of a batch-1 decode step, Qwen3-8B's shapes (e4m3 weights, a scale per
output channel, bf16 activations): worker/quant/gemm.py's GEMV at its default tiles and over a sweep
of (BLOCK_N, BLOCK_K, num_warps), each layer's COPIES (distinct weights, so L2 holds none of them)
replayed in a CUDA graph; median microseconds a call and the bandwidth over the weight's bytes. Gate-up
as the engine runs it, gated (SiLU-and-multiply in the epilogue; BLOCK_N gate rows and as many up rows).

With --blocks, 128 x 128 block-scaled weights instead: a scale loaded a weight against one a block.

    python bench/fp8_gemv.py [--m 1] [--blocks] [--out r.json]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import QWEN3_8B_LINEARS, fp8_weights, time_graph  # noqa: E402

from worker.quant import gemm  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps); 4,096 of K a step reads a 4,096-wide row in one step (one wait on memory a
# program), compiled for sm_90 without spills up to 8 rows (bench/kernel_resources.py's tool, 2026-12-05)
CONFIGS = list(itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8)))
COPIES = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1])
    parser.add_argument("--out")
    parser.add_argument(
        "--blocks", action="store_true", help="only 128 x 128 block scales: a scale loaded a weight against a block"
    )
    args = parser.parse_args()
    if args.blocks:
        return block_scales(args)
    results = []
    for m in args.m:
        for name, (k, n) in QWEN3_8B_LINEARS.items():
            ws, scale = fp8_weights(n, k, COPIES)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gated = name == "gate_up"  # as the engine runs it: SiLU-and-multiply in the epilogue
            ref = x.float() @ (ws[0].float() * scale).T
            if gated:
                ref = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2 :]
            got = gemm.fp8_gemv(x, ws[0], scale, None, gated=gated).float()
            row = {
                "m": m,
                "layer": name,
                "k": k,
                "n": n,
                "gated": gated,
                "max_rel_err": ((got - ref).abs().max() / ref.abs().max()).item(),
            }
            row["default_us"] = time_graph(lambda: [gemm.fp8_gemv(x, w, scale, None, gated=gated) for w in ws]) / COPIES
            row["default_tb_s"] = n * k / row["default_us"] / 1e6
            sweep = {}
            for bn, bk, nw in CONFIGS:
                if gated and bn > 8:  # gate and up rows both: twice the tile
                    continue
                sweep[f"{bn}x{bk}w{nw}"] = (
                    time_graph(lambda: [gemm.fp8_gemv(x, w, scale, None, bn, bk, nw, gated=gated) for w in ws]) / COPIES
                )
            row["sweep_us"] = sweep
            row["best"] = min(sweep, key=sweep.get)
            row["best_tb_s"] = n * k / sweep[row["best"]] / 1e6
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "sweep_us"}))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def block_scales(args: argparse.Namespace) -> None:
    """The GEMV over 128 x 128 block-scaled weights (the scales repeated over each block's rows, as an FP8
    linear keeps them), plain and gated as gate-up runs: a scale loaded for every weight (the default)
    against one a block applied to each block's sum (`grouped`)."""
    results = []
    for m in args.m:
        for name, (k, n) in QWEN3_8B_LINEARS.items():
            ws, _ = fp8_weights(n, k, COPIES)
            scale = torch.rand(n, k // 128, device="cuda") * 0.01 + 0.005
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gated = name == "gate_up"
            row = {"m": m, "layer": name, "k": k, "n": n, "gated": gated}
            want = gemm.fp8_gemv(x, ws[0], scale, (128, 128), gated=gated).float()
            got = gemm.fp8_gemv(x, ws[0], scale, (128, 128), gated=gated, grouped=True).float()
            row["max_rel_diff"] = ((got - want).abs().max() / want.abs().max()).item()
            for variant, grouped in (("default_us", False), ("grouped_us", True)):
                row[variant] = (
                    time_graph(
                        lambda g=grouped: [gemm.fp8_gemv(x, w, scale, (128, 128), gated=gated, grouped=g) for w in ws]
                    )
                    / COPIES
                )
            results.append(row)
            print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
