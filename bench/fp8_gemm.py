"""The linear layers of a decode step at larger batches, Qwen3-8B's shapes (--arch: another's), in bf16 and with e4m3 weights
(a scale per output channel, bf16 activations quantized per token): bf16 through cuBLAS and through the
Triton GEMM of worker/skinny_gemm.py; FP8 through cuBLASLt's rowwise-scaled GEMM (`torch._scaled_mm`),
with the activations' quantization and without, with its fast accumulation and without, and through the
Triton GEMM; each Triton GEMM at its default tile and, with --sweep, at each tile of TILES (the fastest
named). Each layer's COPIES (distinct weights, so L2 holds none of them) replayed in a CUDA graph; median
microseconds a call, and each path's largest error against the float32 product.

    python bench/fp8_gemm.py [--m 16 64 128 256] [--sweep] [--sweep-dtypes fp8] [--layers o down] [--arch qwen3-0.6b]
        [--out r.json]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import LINEARS, fp8_weights, time_graph  # noqa: E402

from worker import skinny_gemm  # noqa: E402
from worker.kernels import Kernels  # noqa: E402
from worker.quant import gemm  # noqa: E402

COPIES = 6
# the sweep: output columns a program, bytes of K a step, pipeline stages, splits of K (the rows a tile:
# skinny_gemm.mm_tile's)
TILES = {"block_n": (32, 64, 128), "k_bytes": (128, 256), "num_stages": (4,), "split_k": (1, 2, 4)}
# past 64 rows the sweep tries both 128-row tiles and 64-row ones (twice the programs: an N = 4,096 layer at
# 128 x 128 fills 64 of an H200's 132 multiprocessors at 256 rows), whichever of them mm_tile picks
SHORT_BLOCK_M = 64
CUBLASLT = Kernels(decode_gemm="vendor")


def sweep(product, m: int, n: int, k: int, element_bytes: int) -> dict:
    """Microseconds a call of `product(tile)` at every tile of TILES that compiles, and the fastest."""
    base = skinny_gemm.mm_tile(m, n, k, element_bytes)
    heights = [(base.block_m, base.num_warps)]
    if m > SHORT_BLOCK_M:  # the other of 128 rows (8 warps past SKINNY_MAX_ROWS, as prompt chunks) and 64
        tall = (128, 8 if m > skinny_gemm.SKINNY_MAX_ROWS else 4)
        heights += [h for h in (tall, (SHORT_BLOCK_M, 4)) if h[0] != base.block_m]
    times = {}
    for (bm, warps), bn, k_bytes, stages, split in itertools.product(heights, *TILES.values()):
        tile = skinny_gemm.MmTile(bm, bn, k_bytes // element_bytes, split, warps, stages)
        try:
            times[str(tile)] = time_graph(lambda t=tile: product(t)) / COPIES
        except Exception as exc:  # a tile past the GPU's shared memory, say
            print(f"  {tile}: {type(exc).__name__}", file=sys.stderr)
    best = min(times, key=times.get)
    return {"sweep_us": times, "best_tile": best, "best_us": times[best]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--sweep", action="store_true", help="each Triton GEMM at every tile of TILES too")
    parser.add_argument(
        "--sweep-dtypes", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"], help="the GEMMs --sweep sweeps"
    )
    parser.add_argument(
        "--layers", nargs="+", choices=sorted(LINEARS["qwen3-8b"]), help="these of the linears only (default: all)"
    )
    parser.add_argument("--arch", choices=sorted(LINEARS), default="qwen3-8b", help="whose linear layers")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for m in args.m:
        for name, (k, n) in LINEARS[args.arch].items():
            if args.layers and name not in args.layers:
                continue
            ws, scale = fp8_weights(n, k, COPIES)
            wb = [w.to(torch.bfloat16) for w in ws]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ (ws[0].float() * scale).T
            ref_b = x.float() @ wb[0].float().T

            def err(y: torch.Tensor, want: torch.Tensor = ref) -> float:
                return ((y.float() - want).abs().max() / want.abs().max()).item()

            row = {"m": m, "layer": name, "k": k, "n": n}
            row["bf16_us"] = time_graph(lambda: [F.linear(x, w) for w in wb]) / COPIES

            def bf16_triton(tile=None):
                return [skinny_gemm.matmul(x, w, x.dtype, tile=tile) for w in wb]

            row["bf16_triton_tile"] = str(skinny_gemm.mm_tile(m, n, k, 2))
            row["bf16_triton_us"] = time_graph(bf16_triton) / COPIES
            row["bf16_triton_err"] = err(skinny_gemm.matmul(x, wb[0], x.dtype), ref_b)
            row["quantize_us"] = time_graph(lambda: gemm.quantize_activations(x, k))
            xq, xs = gemm.quantize_activations(x, k)

            def mm(w: torch.Tensor, fast: bool) -> torch.Tensor:
                # fast: cuBLASLt's fast accumulation, partial sums in the tensor cores' own precision, not promoted
                return torch._scaled_mm(
                    xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype, use_fast_accum=fast
                )

            def fp8_triton(tile=None):
                return [skinny_gemm.matmul(xq, w, x.dtype, xs, scale, tile=tile) for w in ws]

            row["scaled_mm_only_us"] = time_graph(lambda: [mm(w, False) for w in ws]) / COPIES
            row["fast_accum_only_us"] = time_graph(lambda: [mm(w, True) for w in ws]) / COPIES
            row["fast_accum_err"] = err(mm(ws[0], True))
            row["scaled_mm_us"] = time_graph(lambda: [gemm.scaled_mm(x, w, scale, CUBLASLT) for w in ws]) / COPIES
            row["scaled_mm_err"] = err(gemm.scaled_mm(x, ws[0], scale, CUBLASLT))
            row["triton_tile"] = str(skinny_gemm.mm_tile(m, n, k, 1))
            row["triton_only_us"] = time_graph(fp8_triton) / COPIES
            row["triton_err"] = err(skinny_gemm.matmul(xq, ws[0], x.dtype, xs, scale))
            if args.sweep and "fp8" in args.sweep_dtypes:
                row["fp8_sweep"] = sweep(fp8_triton, m, n, k, 1)
            if args.sweep and "bf16" in args.sweep_dtypes:
                row["bf16_sweep"] = sweep(bf16_triton, m, n, k, 2)
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if not key.endswith("_sweep")}))
            for dtype in ("fp8", "bf16"):
                if f"{dtype}_sweep" in row:
                    print(
                        f"  {dtype} best: {row[f'{dtype}_sweep']['best_tile']} {row[f'{dtype}_sweep']['best_us']:.2f} us"
                    )
    for m in args.m:
        rows = [r for r in results if r["m"] == m]

        def total(key: str) -> float:
            return sum(r[key] for r in rows)

        best = ""
        for dtype in ("bf16", "fp8"):
            if args.sweep and dtype in args.sweep_dtypes:
                best += f"; the sweep's best {dtype}: {sum(r[f'{dtype}_sweep']['best_us'] for r in rows):.1f}"
        print(
            f"M={m}, the layer's {len(rows)} linears timed, us: bf16 cuBLAS {total('bf16_us'):.1f}, Triton "
            f"{total('bf16_triton_us'):.1f}; FP8 cuBLASLt (fast accumulation) {total('fast_accum_only_us'):.1f}, "
            f"Triton {total('triton_only_us'):.1f}{best}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
