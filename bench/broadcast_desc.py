"""Time to broadcast one step's batch description from rank 0 to the other ranks of a replica (the gloo
CPU group a replica uses), and the follower's host time to receive it, for decode batches and a long
prefill; the packed broadcast (worker/comm.py) beside the pickled one it replaced.

    python bench/broadcast_desc.py [--ranks 2] [--device cuda] [--message-kib 32] [--out results.json]

Rank 0 pauses --gap-ms before each broadcast, so that the followers wait in their receive, as they
do between steps; the methods take turns (--rounds), so that load from outside falls on each alike.
Per case and method, medians over --repeats steps:
- rank 0 us: rank 0's call (pickling or packing, and the broadcasts), which its own launch waits for;
- delivered us: from rank 0's call to the follower holding the description (the clock is shared),
  after which it launches;
- follower CPU us: the CPU time of the follower's process (every thread: gloo's too) over its call,
  its host cost per step: receiving, then unpickling or unpacking;
- decode us: the unpickling, or the unpacking, alone.

With --device cuda each rank joins the group as a replica's rank does on GPUs (NCCL for the model's
collectives, the gloo group beside it for the broadcast) and first checks an all-reduce over NCCL.
--message-kib takes several sizes of the packed broadcast's fixed message, to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.batch import BatchDesc, desc_layout, pack_desc, packed_nbytes, unpack_desc
from worker.comm import DescChannel, free_address, init_tensor_parallel


def decode_desc(batch: int) -> BatchDesc:
    rng = np.random.default_rng(0)
    return BatchDesc(
        is_prefill=False,
        slots=np.arange(batch, dtype=np.int32),
        seq_lens=rng.integers(100, 2048, batch).astype(np.int32),
        extend_lens=np.ones(batch, dtype=np.int32),
        out_loc=rng.integers(0, 1 << 20, batch).astype(np.int32),
        input_ids=None,
        temperature=np.full(batch, 0.6, dtype=np.float32),
        top_p=np.ones(batch, dtype=np.float32),
        top_k=np.full(batch, -1, dtype=np.int32),
        seeds=rng.integers(0, 1 << 62, batch),
    )


def prefill_desc(requests: int = 8, tokens_each: int = 1024, hit_rows: int = 2, hit_len: int = 512) -> BatchDesc:
    """8,192 prompt tokens (the default max_extend_tokens) from 8 requests, two of them after a
    prefix-cache hit (their page-table rows are rewritten)."""
    rng = np.random.default_rng(1)
    tokens = requests * tokens_each
    rows = [(i, rng.integers(0, 1 << 20, hit_len).astype(np.int32)) for i in range(hit_rows)]
    return BatchDesc(
        is_prefill=True,
        slots=np.arange(requests, dtype=np.int32),
        seq_lens=np.full(requests, tokens_each, dtype=np.int32),
        extend_lens=np.full(requests, tokens_each, np.int32),
        out_loc=rng.integers(0, 1 << 20, tokens).astype(np.int32),
        input_ids=rng.integers(0, 150000, tokens).astype(np.int32),
        temperature=np.full(requests, 0.6, dtype=np.float32),
        top_p=np.ones(requests, dtype=np.float32),
        top_k=np.full(requests, -1, dtype=np.int32),
        seeds=rng.integers(0, 1 << 62, requests),
        prefix_slots=rows,
    )


CASES: dict[str, Callable[[], BatchDesc]] = {
    "decode 1": lambda: decode_desc(1),
    "decode 64": lambda: decode_desc(64),
    "decode 256": lambda: decode_desc(256),
    "prefill 8k": prefill_desc,
}


def pickled_broadcast(group: dist.ProcessGroup) -> Callable[[BatchDesc | None], BatchDesc]:
    """The broadcast as it was: broadcast_object_list (pickles, then a size and a bytes broadcast)."""

    def broadcast(desc):
        box = [desc]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return broadcast


def packed_broadcast(
    group: dist.ProcessGroup, rank: int, message_bytes: int
) -> Callable[[BatchDesc | None], BatchDesc]:
    channel = DescChannel(group, message_bytes)
    return (lambda desc: channel.send(desc) or desc) if rank == 0 else (lambda desc: channel.receive())


def median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_us(method: str, desc: BatchDesc, repeats: int) -> float:
    """What the follower does with the received bytes: unpickling them (broadcast_object_list's
    unpickler is pickle's), or unpacking the header's layout and the payload."""
    if method == "pickle":
        data = pickle.dumps(desc)
        return median_us(lambda: pickle.loads(data), repeats)
    layout = desc_layout(desc)
    buf = np.zeros(packed_nbytes(layout), np.uint8)
    pack_desc(desc, layout, buf)
    header = np.array(layout, dtype=np.int64)
    return median_us(lambda: unpack_desc(tuple(header.tolist()), buf), repeats)


def run_steps(
    broadcast: Callable, desc: BatchDesc | None, steps: int, gap_s: float, want: BatchDesc
) -> dict[str, list[float]]:
    """`steps` broadcasts, rank 0 pausing gap_s before each (as between steps: the followers are then
    waiting in their receive). Each call's start and end on the shared monotonic clock, and its CPU
    time over every thread of the process (gloo's too)."""
    times: dict[str, list[float]] = {"start": [], "end": [], "cpu": []}
    for _ in range(steps):
        if desc is not None and gap_s:
            time.sleep(gap_s)
        cpu, start = time.process_time(), time.perf_counter()
        got = broadcast(desc)
        times["end"].append(time.perf_counter())
        times["start"].append(start)
        times["cpu"].append(time.process_time() - cpu)
        assert got.num_tokens == want.num_tokens and got.out_loc[-1] == want.out_loc[-1]
    return times


def worker(
    rank: int,
    size: int,
    address: str,
    device: str,
    message_kib: list[int],
    repeats: int,
    rounds: int,
    gap_s: float,
    out: dict,
) -> None:
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    tp = init_tensor_parallel(rank, size, address, dev, 60)
    comm = tp.comm
    x = comm.all_reduce(torch.full((1024,), rank + 1.0, device=dev))
    assert x.eq(size * (size + 1) / 2).all().item(), "all-reduce gave a wrong sum"
    assert comm.min_over_ranks(100 + rank) == 100
    methods = {"pickle": pickled_broadcast(comm.cpu_group)}
    methods |= {f"packed {kib} KiB": packed_broadcast(comm.cpu_group, rank, kib * 1024) for kib in message_kib}
    for case, make in CASES.items():
        want = make()
        desc = want if rank == 0 else None
        runs: dict[str, dict[str, list[float]]] = {m: {"start": [], "end": [], "cpu": []} for m in methods}
        for _ in range(rounds):  # the methods in turn, so that load from outside falls on each alike
            for method, broadcast in methods.items():
                for key, values in run_steps(broadcast, desc, repeats // rounds + 10, gap_s, want).items():
                    runs[method][key] += values[10:]  # the first calls of a round warm caches up
        for method in methods:
            decode = decode_us(method, want, repeats) if rank == 1 else None
            out[(case, method, rank)] = {**runs[method], "decode_us": decode}
        comm.all_reduce(torch.zeros(1, device=dev))  # the ranks leave the case together
    dist.destroy_process_group()


def summary(rank0: dict[str, list[float]], follower: dict) -> dict[str, float]:
    def us(values) -> float:
        return statistics.median(values) * 1e6

    return {
        "rank0_us": us(np.subtract(rank0["end"], rank0["start"])),
        "delivered_us": us(np.subtract(follower["end"], rank0["start"])),
        "follower_cpu_us": us(follower["cpu"]),
        "decode_us": follower["decode_us"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--message-kib", type=int, nargs="+", default=[DescChannel.MESSAGE_BYTES // 1024])
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=0.5, help="rank 0's pause before each broadcast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    address = free_address("127.0.0.1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(
            worker,
            args=(
                args.ranks,
                address,
                args.device,
                args.message_kib,
                args.repeats,
                args.rounds,
                args.gap_ms / 1e3,
                out,
            ),
            nprocs=args.ranks,
            join=True,
        )
        rows = [
            {
                "case": case,
                "method": method,
                "ranks": args.ranks,
                "device": args.device,
                **summary(out[(case, method, 0)], out[(case, method, 1)]),
            }
            for case, method, rank in out.keys()
            if rank == 0
        ]
    methods = ["pickle"] + [f"packed {kib} KiB" for kib in args.message_kib]
    rows.sort(key=lambda r: (list(CASES).index(r["case"]), methods.index(r["method"])))
    print(
        f"{'case':>11} {'method':>16} {'rank 0 us':>10} {'delivered us':>13} {'follower CPU us':>16} {'decode us':>10}"
    )
    for r in rows:
        print(
            f"{r['case']:>11} {r['method']:>16} {r['rank0_us']:>10.1f} {r['delivered_us']:>13.1f} "
            f"{r['follower_cpu_us']:>16.1f} {r['decode_us']:>10.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
