"""bf16 linear layers at decode batches' row counts: torch's `F.linear` (cuBLAS's own pick, and with torch preferring cuBLASLt) against every
algorithm cuBLASLt's heuristic lists for the shape, each timed in a CUDA graph over COPIES distinct weights
(worker/cublaslt.py). Qwen3-8B's and Qwen3-0.6B's layers; median microseconds a call, the fastest
algorithm's configuration, and its largest difference from F.linear's output.

    python bench/cublaslt_algos.py [--m 256 128 64 16] [--arch qwen3-8b qwen3-0.6b] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import LINEARS, time_graph  # noqa: E402

from worker.cublaslt import LtLinear  # noqa: E402

COPIES = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[256, 128, 64, 16])
    parser.add_argument("--arch", nargs="+", choices=sorted(LINEARS), default=["qwen3-8b", "qwen3-0.6b"])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    print(
        f"{'arch':<11} {'layer':<8} {'m':>4} {'F.linear':>9} {'torch lt':>9} {'lt first':>9} {'lt best':>9} {'ratio':>6} algos  best"
    )
    for arch in args.arch:
        for m in args.m:
            for name, (k, n) in LINEARS[arch].items():
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(COPIES)]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                torch_us = time_graph(lambda: [F.linear(x, w) for w in ws]) / COPIES
                torch.backends.cuda.preferred_blas_library("cublaslt")
                torch_lt_us = time_graph(lambda: [F.linear(x, w) for w in ws]) / COPIES
                torch.backends.cuda.preferred_blas_library("cublas")
                lt = LtLinear(m, n, k, torch.bfloat16, x.device)
                timings = lt.tune(x, ws)
                best = min(range(len(timings)), key=timings.__getitem__)
                ref = F.linear(x, ws[0]).float()
                got = lt(x, ws[0], out).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                row = {
                    "arch": arch,
                    "layer": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "torch_us": torch_us,
                    "torch_cublaslt_us": torch_lt_us,
                    "lt_first_us": timings[0],
                    "lt_best_us": timings[best],
                    "lt_us": timings,
                    "algos": [asdict(lt.info(i)) for i in range(len(timings))],
                    "best": asdict(lt.info(best)),
                    "rel_err": err,
                }
                results.append(row)
                b = row["best"]
                print(
                    f"{arch:<11} {name:<8} {m:>4} {torch_us:>9.2f} {torch_lt_us:>9.2f} {timings[0]:>9.2f} {timings[best]:>9.2f} "
                    f"{timings[best] / torch_us:>6.3f} {len(timings):>5}  id {b['algo_id']} tile {b['tile_id']} "
                    f"split {b['split_k']} stages {b['stages_id']} err {err:.1e}",
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
