"""What tensor parallelism's all-reduces cost a decode step: one CUDA graph holding a model's worth of
all-reduces (two a layer) of one step's hidden states, replayed on every rank, with NCCL through
torch.distributed and, where this torch has it, torch's symmetric-memory one-shot all-reduce.

    python bench/allreduce.py [--ranks 2] [--hidden 4096] [--layers 36] [--batch 1 64 256] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.comm import free_address, init_tensor_parallel

REPLAYS = 20


def time_graph(fn, stream: torch.cuda.Stream) -> float:
    """Median ms of one replay of a graph of fn."""
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def worker(rank: int, size: int, address: str, args, out: dict) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, address, device, 60)
    stream = torch.cuda.Stream()
    n = 2 * args.layers
    for batch in args.batch:
        x = torch.randn(batch, args.hidden, dtype=torch.bfloat16, device=device)
        row = {"batch": batch, "all_reduces": n}

        def nccl():
            for _ in range(n):
                tp.comm.all_reduce(x)

        row["nccl_ms"] = time_graph(nccl, stream)
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            buf = symm_mem.empty(x.shape, dtype=x.dtype, device=device)
            symm_mem.rendezvous(buf, group)

            def one_shot():
                for _ in range(n):
                    buf.copy_(x)
                    torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, x)

            row["symm_mem_one_shot_ms"] = time_graph(one_shot, stream)
        except Exception as e:  # noqa: BLE001 - report what this torch cannot do, keep the NCCL figure
            row["symm_mem_one_shot_error"] = f"{type(e).__name__}: {e}"[:300]
        if rank == 0:
            out[batch] = row
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    address = free_address("127.0.0.1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args.ranks, address, args, out), nprocs=args.ranks, join=True)
        rows = [out[b] for b in args.batch]
    print(f"{'batch':>6} {'all-reduces':>12} {'NCCL ms':>9} {'one-shot ms':>12}  (one graph replay)")
    for r in rows:
        one_shot = f"{r['symm_mem_one_shot_ms']:.3f}" if "symm_mem_one_shot_ms" in r else "n/a"
        print(f"{r['batch']:>6} {r['all_reduces']:>12} {r['nccl_ms']:>9.3f} {one_shot:>12}")
        if "symm_mem_one_shot_error" in r:
            print(f"       one-shot: {r['symm_mem_one_shot_error']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
