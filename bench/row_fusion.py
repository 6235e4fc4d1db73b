"""Batch-1 decode's fused launches (worker/layers/row_fusion.py) against the two launches each replaces:
FlashInfer's residual norm then the Triton GEMV, and FlashInfer's SiLU-and-multiply then the GEMV; on the
layers of Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B (bf16), each as many distinct copies as the model has
layers (so L2 does not hold the weights) replayed in a CUDA graph. Median microseconds a layer, the
fused kernel's default tiles and a sweep of its output columns a program; for the norm, `fused_us` is its
two passes over the row and `one_block_us` the whole row in one block (the default up to
gemv.ONE_BLOCK_MAX_ELEMENTS; timed up to ONE_BLOCK_TIMED_MAX_K, past the rows the engine fuses); and the largest
difference between the fused and the separate outputs.

    python bench/row_fusion.py [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_graph  # noqa: E402

from worker import gemv  # noqa: E402
from worker.layers.fused import fused_ops  # noqa: E402
from worker.layers.row_fusion import NORM_MAX_K  # noqa: E402

# (architecture, layers, part, K, N): "norm" parts fuse the residual norm into the GEMV over K -> N
# ("norm+normed" also writes the normed row, as the mixture's router does); "silu" parts read [gate | up]
# The widest row whose one-block variant is timed: past the engine's fusion (NORM_MAX_K), so that Qwen3-8B's
# 4,096-wide rows, where the two passes lost to the separate launches, are timed in one block too
ONE_BLOCK_TIMED_MAX_K = 2 * NORM_MAX_K
SHAPES = [
    ("qwen3-0.6b", 28, "norm", 1024, 4096),  # input norm + qkv
    ("qwen3-0.6b", 28, "norm", 1024, 6144),  # post-attention norm + gate-up
    ("qwen3-0.6b", 28, "silu", 3072, 1024),  # SiLU + down
    ("qwen3-8b", 36, "norm", 4096, 6144),
    ("qwen3-8b", 36, "norm", 4096, 24576),
    ("qwen3-8b", 36, "silu", 12288, 4096),
    ("qwen3-30b-a3b", 48, "norm", 2048, 5120),
    ("qwen3-30b-a3b", 48, "norm+normed", 2048, 128),  # post-attention norm + the router, writing the normed row
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    ops = fused_ops(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    results = []
    for arch, layers, part, k, n in SHAPES:
        dt = torch.bfloat16
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        row = {"arch": arch, "part": part, "k": k, "n": n}
        if part.startswith("norm"):
            normed = part == "norm+normed"
            x, res = torch.randn(1, k, device="cuda", dtype=dt), torch.randn(1, k, device="cuda", dtype=dt)
            nw = torch.rand(k, device="cuda", dtype=dt) + 0.5
            xs, rs = x.clone(), res.clone()

            def separate():
                for w in ws:
                    ops.fused_add_rmsnorm(xs, rs, nw, 1e-6)
                    gemv.small_linear(xs, w)

            def fused(bn=None, one_block=False):
                for w in ws:
                    gemv.norm_linear(x, res, nw, 1e-6, w, normed, block_n=bn, one_block=one_block)

            if k <= ONE_BLOCK_TIMED_MAX_K:  # the whole row in one block, every load issued before the norm's sum
                row["one_block_us"] = time_graph(lambda: fused(one_block=True)) / layers
                row["one_block_sweep_us"] = {
                    bn: time_graph(lambda bn=bn: fused(bn, True)) / layers for bn in (1, 2, 4, 8, 16)
                }
                got = gemv.norm_linear(x, res, nw, 1e-6, ws[0], normed, one_block=True)[0]
                a, b = x.clone(), res.clone()
                ops.fused_add_rmsnorm(a, b, nw, 1e-6)
                row["one_block_max_abs_diff"] = (got.float() - gemv.small_linear(a, ws[0]).float()).abs().max().item()

            a, b = x.clone(), res.clone()
            ops.fused_add_rmsnorm(a, b, nw, 1e-6)
            ref = gemv.small_linear(a, ws[0])
            got, new_res, got_normed = gemv.norm_linear(x, res, nw, 1e-6, ws[0], normed)
            row["max_abs_diff"] = (got.float() - ref.float()).abs().max().item()
            row["residual_equal"] = torch.equal(new_res, b)
            if normed:
                row["normed_max_abs_diff"] = (got_normed.float() - a.float()).abs().max().item()
        else:
            gu = torch.randn(1, 2 * k, device="cuda", dtype=dt)

            def separate():
                for w in ws:
                    gemv.small_linear(ops.silu_and_mul(gu), w)

            def fused(bn=None):
                for w in ws:
                    gemv.silu_linear(gu, w, block_n=bn)

            ref = gemv.small_linear(ops.silu_and_mul(gu), ws[0])
            row["max_abs_diff"] = (gemv.silu_linear(gu, ws[0]).float() - ref.float()).abs().max().item()
        row["separate_us"] = time_graph(separate) / layers
        row["fused_us"] = time_graph(fused) / layers
        row["sweep_us"] = {bn: time_graph(lambda bn=bn: fused(bn)) / layers for bn in (1, 2, 4, 8, 16)}
        row["saved_per_layer_us"] = row["separate_us"] - row["fused_us"]
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
