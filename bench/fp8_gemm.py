"""The FP8-weight linear layers of a decode step at larger batches, Qwen3-8B's shapes (e4m3 weights, a
scale per output channel, bf16 activations quantized per token): bf16 cuBLAS beside the FP8 path at M
rows, cuBLASLt's rowwise-scaled GEMM (`torch._scaled_mm`), with the activations' quantization and without,
and the quantization alone; the GEMM alone with cuBLASLt's fast accumulation and without. Each layer's
COPIES (distinct weights, so L2 holds none of them) replayed in a CUDA graph; median microseconds a call,
and the FP8 path's largest error against the float32 product.

    python bench/fp8_gemm.py [--m 64 128 256] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import QWEN3_8B_LINEARS, fp8_weights, time_graph  # noqa: E402

from worker.quant import gemm  # noqa: E402

COPIES = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512])
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
            row["scaled_mm_us"] = time_graph(lambda: [gemm.scaled_mm(x, w, scale) for w in ws]) / COPIES
            row["scaled_mm_err"] = err(gemm.scaled_mm(x, ws[0], scale))
            results.append(row)
            print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
