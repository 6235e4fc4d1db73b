"""Batch-1 decode's fused launches (worker/layers/row_fusion.py) against the two launches each replaces:
FlashInfer's residual norm then the Triton GEMV, and FlashInfer's SiLU-and-multiply then the GEMV; on the
layers of Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B (bf16), each as many distinct copies as the model has
layers (so L2 does not hold the weights) replayed in a CUDA graph. Median microseconds a layer, the
fused kernel's default tiles and a sweep of its output columns a program; for the norm, `fused_us` is its
two passes over the row and `one_block_us` the whole row in one block (the default up to
gemv.ONE_BLOCK_MAX_ELEMENTS; timed up to ONE_BLOCK_TIMED_MAX_K, past the rows the engine fuses); and the largest
difference between the fused and the separate outputs.

Then Qwen3-8B's norms before gate-up's GEMV with the SiLU in its epilogue and before FP8 weights' GEMVs
(`gated_and_fp8`).

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
    for row in gated_and_fp8(ops):
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


# Qwen3-8B's norms before a GEMV that applies the SiLU itself (gate-up, where down's GEMV cannot take it) and
# before FP8 weights' GEMVs: (part, K, N, weight dtype, gated)
GATED_AND_FP8 = [
    ("norm+gate_up_silu", 4096, 12288, "bf16", True),
    ("norm+qkv", 4096, 6144, "fp8", False),
    ("norm+gate_up_silu", 4096, 12288, "fp8", True),
    ("norm+gate_up_silu", 4096, 12288, "fp8_block", True),
]


def gated_and_fp8(ops) -> list[dict]:
    """On Qwen3-8B's widths (36 copies): FlashInfer's residual norm then the GEMV (bf16, or FP8 per channel
    or in 128 x 128 blocks; gated: SiLU-and-multiply in its epilogue) against gemv.norm_linear doing both,
    at its default tile, at 1, 2 and 4 columns a program and in two passes."""
    from worker.quant import gemm

    rows, layers, dt = [], 36, torch.bfloat16
    for part, k, n, wdt, gated in GATED_AND_FP8:
        rows_n = 2 * n if gated else n
        ws = [torch.randn(rows_n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        scale, block = None, None
        if wdt == "fp8":
            scale = torch.rand(rows_n, device="cuda") * 0.01 + 0.005
        elif wdt == "fp8_block":  # 128 x 128 blocks, their scales repeated over each block's rows
            scale, block = torch.rand(rows_n, k // 128, device="cuda") * 0.01 + 0.005, (128, 128)
        if scale is not None:
            ws = [w.to(torch.float8_e4m3fn) for w in ws]
        x, res = torch.randn(1, k, device="cuda", dtype=dt), torch.randn(1, k, device="cuda", dtype=dt)
        nw = torch.rand(k, device="cuda", dtype=dt) + 0.5
        xs, rs = x.clone(), res.clone()

        def gemv_of(a, w):
            if scale is None:
                return gemv.small_linear(a, w, gated=gated)
            return gemm.fp8_gemv(a, w, scale, block, gated=gated)

        def separate():
            for w in ws:
                ops.fused_add_rmsnorm(xs, rs, nw, 1e-6)
                gemv_of(xs, w)

        def fused(bn=None):
            for w in ws:
                gemv.norm_linear(x, res, nw, 1e-6, w, block_n=bn, scale=scale, block=block, gated=gated)

        a, b = x.clone(), res.clone()
        ops.fused_add_rmsnorm(a, b, nw, 1e-6)
        got = gemv.norm_linear(x, res, nw, 1e-6, ws[0], scale=scale, block=block, gated=gated)[0]
        row = {"arch": "qwen3-8b", "part": part, "weights": wdt, "k": k, "n": n}
        row["max_abs_diff"] = (got.float() - gemv_of(a, ws[0]).float()).abs().max().item()
        row["separate_us"] = time_graph(separate) / layers
        row["fused_us"] = time_graph(fused) / layers
        row["sweep_us"] = {bn: time_graph(lambda bn=bn: fused(bn)) / layers for bn in (1, 2, 4)}
        row["two_pass_us"] = (
            time_graph(
                lambda: [
                    gemv.norm_linear(x, res, nw, 1e-6, w, scale=scale, block=block, gated=gated, one_block=False)
                    for w in ws
                ]
            )
            / layers
        )
        row["saved_per_layer_us"] = row["separate_us"] - row["fused_us"]
        rows.append(row)
        ws.clear()
    return rows


if __name__ == "__main__":
    main()
