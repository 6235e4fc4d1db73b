"""The dense layers of a batch-1 decode step (Qwen3-0.6B shapes, bf16): cuBLAS (F.linear, by default and
with cuBLASLt preferred) against a Triton GEMV, each layer's 28 copies (distinct weights, so L2 does
not hold them) replayed in a CUDA graph; median microseconds per call and the bandwidth it reaches. The
GEMV also with programmatic dependent launch (each copy prefetching its weights while the one before
runs: `triton_pdl_us`, on compute capability 9.0+), and the LM heads of Qwen3-0.6B and Qwen3-8B (four
copies: 0.3 and 1.2 GB each), which run through cuBLAS at batch 1.

    python bench/small_gemm.py [--m 1] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_graph  # noqa: E402

from worker import gemv  # noqa: E402

CONFIGS = [
    (2, 1024, 4),
    (4, 512, 4),
    (4, 1024, 4),
    (8, 256, 4),
    (8, 512, 4),
    (8, 1024, 8),
    (16, 256, 4),
    (16, 512, 8),
    (32, 128, 4),
    (4, 256, 2),
    (2, 512, 2),
    (1, 1024, 4),
]
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
LM_HEADS = {"lm_head_0.6b": (1024, 151936), "lm_head_8b": (4096, 151936)}
COPIES = {**{name: 28 for name in SHAPES}, **{name: 4 for name in LM_HEADS}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    pdl = torch.cuda.get_device_capability() >= (9, 0)
    for m in args.m:
        for name, (k, n) in {**SHAPES, **LM_HEADS}.items():
            copies = COPIES[name]
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            got = gemv.small_linear(x, ws[0])
            err = (got.float() - ref.float()).abs().max().item()
            row = {"m": m, "layer": name, "k": k, "n": n, "triton_max_abs_err": err}
            row["cublas_us"] = time_graph(lambda: [F.linear(x, w) for w in ws]) / copies
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["cublaslt_us"] = time_graph(lambda: [F.linear(x, w) for w in ws]) / copies
            torch.backends.cuda.preferred_blas_library("cublas")
            row["triton_us"] = time_graph(lambda: [gemv.small_linear(x, w) for w in ws]) / copies
            row["triton_tb_s"] = n * k * 2 / row["triton_us"] / 1e6
            if pdl:
                assert torch.equal(gemv.small_linear(x, ws[0], pdl=True), got)
                row["triton_pdl_us"] = time_graph(lambda: [gemv.small_linear(x, w, pdl=True) for w in ws]) / copies
            if m == 1 and name in SHAPES:  # block shapes (block_n, block_k, num_warps)
                sweep = {}
                for bn, bk, nw in CONFIGS:
                    sweep[f"{bn}x{bk}w{nw}"] = (
                        time_graph(lambda: [gemv.small_linear(x, w, bn, bk, nw) for w in ws]) / copies
                    )
                row["sweep_us"] = sweep
                row["best"] = min(sweep, key=sweep.get)
            row["cublas_tb_s"] = n * k * 2 / row["cublas_us"] / 1e6
            results.append(row)
            print(json.dumps(row))
            ws.clear()  # the LM heads: gigabytes
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
