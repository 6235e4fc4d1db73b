"""Time to broadcast one decode batch description from rank 0 to the other ranks of a replica
(the gloo CPU group a replica uses), at several batch sizes.

    python bench/broadcast_desc.py [--ranks 2] [--device cuda] [--out results.json]

With --device cuda each rank joins the group as a replica's rank does on GPUs (NCCL for the model's
collectives, the gloo group beside it for the broadcast) and first checks an all-reduce over NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from worker.batch import BatchDesc
from worker.comm import free_address, init_tensor_parallel

BATCHES = (1, 64, 256)
REPEATS = 500


def decode_desc(batch: int) -> BatchDesc:
    rng = np.random.default_rng(0)
    return BatchDesc(
        is_prefill=False, table_idx=np.arange(batch, dtype=np.int32),
        seq_lens=rng.integers(100, 2048, batch).astype(np.int32), extend_lens=np.ones(batch, dtype=np.int32),
        out_loc=rng.integers(0, 1 << 20, batch).astype(np.int32), input_ids=None,
        temperature=np.full(batch, 0.6, dtype=np.float32), top_p=np.ones(batch, dtype=np.float32),
        top_k=np.full(batch, -1, dtype=np.int32), seeds=rng.integers(0, 1 << 62, batch))


def worker(rank: int, size: int, address: str, device: str, out: dict) -> None:
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    tp = init_tensor_parallel(rank, size, address, dev, 60)
    comm = tp.comm
    x = comm.all_reduce(torch.full((1024,), rank + 1.0, device=dev))
    assert x.eq(size * (size + 1) / 2).all().item(), "all-reduce gave a wrong sum"
    assert comm.min_over_ranks(100 + rank) == 100
    for batch in BATCHES:
        desc = decode_desc(batch) if rank == 0 else None
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            got = comm.broadcast_desc(desc)
            times.append(time.perf_counter() - start)
        assert got.batch_size == batch
        if rank == 0:
            out[batch] = statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    address = free_address("127.0.0.1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args.ranks, address, args.device, out), nprocs=args.ranks, join=True)
        rows = [{"batch": b, "ranks": args.ranks, "device": args.device, "us_median": out[b]} for b in BATCHES]
    print(f"{'batch':>6} {'ranks':>6} {'us (median)':>12}")
    for r in rows:
        print(f"{r['batch']:>6} {r['ranks']:>6} {r['us_median']:>12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
