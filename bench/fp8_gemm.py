"""The FP8-weight linear layers of a decode step at larger batches, Qwen3-8B's shapes (e4m3 weights, a
scale per output channel, bf16 activations quantized per token): bf16 cuBLAS beside the FP8 path at M
rows, cuBLASLt's rowwise-scaled GEMM (`torch._scaled_mm`), with the activations' quantization and without,
and the quantization alone; the GEMM alone with cuBLASLt's fast accumulation and without; the Triton GEMM
(gemm.triton_scaled_mm) at its default tile and, with --sweep, at each tile of TILES (the one that wins
named). Each layer's COPIES (distinct weights, so L2 holds none of them) replayed in a CUDA graph; median
microseconds a call, and each FP8 path's largest error against the float32 product.

    python bench/fp8_gemm.py [--m 64 128 256] [--sweep] [--out r.json]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import QWEN3_8B_LINEARS, fp8_weights, time_graph  # noqa: E402

from worker.kernels import Kernels  # noqa: E402
from worker.quant import gemm  # noqa: E402

COPIES = 6
# the sweep: output columns a program, K a step, pipeline stages, splits of K (the rows a tile: gemm.mm_tile's)
TILES = {"block_n": (32, 64, 128), "block_k": (128, 256), "num_stages": (3, 4), "split_k": (1, 2, 4)}


def sweep(m: int, n: int, k: int, xq, xs, ws, scale) -> dict:
    """Microseconds a call of every tile of TILES that compiles, and the fastest."""
    base = gemm.mm_tile(m, n, k, None)
    times = {}
    for bn, bk, stages, split in itertools.product(*TILES.values()):
        tile = gemm.MmTile(base.block_m, bn, bk, split, base.num_warps, stages)
        try:
            times[str(tile)] = (
                time_graph(
                    lambda t=tile: [gemm.triton_scaled_mm(xq, xs, w, scale, torch.bfloat16, None, t) for w in ws]
                )
                / COPIES
            )
        except Exception as exc:  # a tile past the GPU's shared memory, say
            print(f"  {tile}: {type(exc).__name__}", file=sys.stderr)
    best = min(times, key=times.get)
    return {"sweep_us": times, "best_tile": best, "best_us": times[best]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--sweep", action="store_true", help="the Triton GEMM at every tile of TILES too")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for m in args.m:
        for name, (k, n) in QWEN3_8B_LINEARS.items():
            ws, scale = fp8_weights(n, k, COPIES)
            wb = [w.to(torch.bfloat16) for w in ws]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ (ws[0].float() * scale).T

            def err(y: torch.Tensor) -> float:
                return ((y.float() - ref).abs().max() / ref.abs().max()).item()

            row = {"m": m, "layer": name, "k": k, "n": n}
            row["bf16_us"] = time_graph(lambda: [F.linear(x, w) for w in wb]) / COPIES
            row["quantize_us"] = time_graph(lambda: gemm.quantize_activations(x, k))
            xq, xs = gemm.quantize_activations(x, k)

            def mm(w: torch.Tensor, fast: bool) -> torch.Tensor:
                # fast: cuBLASLt's fast accumulation, partial sums in the tensor cores' own precision, not promoted
                return torch._scaled_mm(
                    xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype, use_fast_accum=fast
                )

            row["scaled_mm_only_us"] = time_graph(lambda: [mm(w, False) for w in ws]) / COPIES
            row["fast_accum_only_us"] = time_graph(lambda: [mm(w, True) for w in ws]) / COPIES
            row["fast_accum_err"] = err(mm(ws[0], True))
            cublaslt = Kernels(fp8_gemm="cublaslt")
            row["scaled_mm_us"] = time_graph(lambda: [gemm.scaled_mm(x, w, scale, cublaslt) for w in ws]) / COPIES
            row["scaled_mm_err"] = err(gemm.scaled_mm(x, ws[0], scale, Kernels(fp8_gemm="cublaslt")))
            tile = gemm.mm_tile(m, n, k, None)
            row["triton_tile"] = str(tile)
            row["triton_only_us"] = (
                time_graph(lambda: [gemm.triton_scaled_mm(xq, xs, w, scale, x.dtype, None, tile) for w in ws]) / COPIES
            )
            row["triton_err"] = err(gemm.triton_scaled_mm(xq, xs, ws[0], scale, x.dtype, None, tile))
            if args.sweep:
                row.update(sweep(m, n, k, xq, xs, ws, scale))
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "sweep_us"}))
    for m in args.m:
        rows = [r for r in results if r["m"] == m]
        total = {key: sum(r[key] for r in rows) for key in ("bf16_us", "fast_accum_only_us", "triton_only_us")}
        best = f", the sweep's best {sum(r['best_us'] for r in rows):.1f}" if args.sweep else ""
        print(
            f"M={m}: a layer's four linears, us: bf16 {total['bf16_us']:.1f}, cuBLASLt FP8 (fast accumulation) "
            f"{total['fast_accum_only_us']:.1f}, Triton FP8 {total['triton_only_us']:.1f}{best}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
