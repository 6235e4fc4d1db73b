"""Decode steps of a tensor-parallel replica timed on the GPU: the ranks are plain processes (no Ray),
rank 0 runs the scheduler with the tensor-parallel executor and CUDA events around every step, the
other ranks run the follower loop. Per batch size: ms per output token, rank 0's GPU time per decode
step, and its idle time between steps (waiting for the host, or for a peer inside an all-reduce).
`--tp-size 1` runs the same harness on one GPU, for a side-by-side ratio.

    python bench/tp_step_time.py --arch qwen3-8b --tp-size 2 --batch 64 1 [--out r.json]

Known problem: on the 2-GPU H200 host its tp=2 run has hung twice before printing anything (with the
ranks' devices given explicitly, then with one visible GPU per rank); tp=1 there and tp=2 on CPUs
(gloo) run. Until that is understood, `decode_latency.py --tp-size 2` (through Ray) is the tp=2 figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.multiprocessing as mp
from common import ARCHS, StepTimer, model_folder
from decode_latency import measure

from cluster.config import SchedulerConfig
from cluster.engine_executors import LocalExecutor, TensorParallelExecutor
from cluster.messages import AddRequest
from cluster.scheduler import Scheduler
from worker.comm import free_address, init_tensor_parallel
from worker.config import EngineConfig
from worker.engine import Engine
from worker.follower import Follower


class Rank0:
    """The part of `LLM` that `decode_latency.measure` uses, over a scheduler driven in this process."""

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine, self.scheduler = engine, scheduler
        self._uids = itertools.count()

    def generate(self, prompts, params) -> None:
        for ids in prompts:
            self.scheduler.submit(AddRequest(next(self._uids), ids, params))
        while self.scheduler.has_work:
            self.scheduler.step()


def rank_main(rank: int, args, folder: str, address: str, out: dict) -> None:
    if args.device == "cuda":  # one visible GPU per rank, as Ray gives each rank of a replica
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    config = EngineConfig(model_path=folder, dtype="bfloat16", load_format="dummy", page_size=args.page_size,
                          max_running_reqs=max(args.batch), device=args.device)
    if rank > 0:
        follower = Follower(config, rank, args.tp_size, address, 60)
        follower.start()
        follower.run()
        return
    if args.tp_size > 1:
        tp = init_tensor_parallel(0, args.tp_size, address, torch.device(args.device), 60)
        engine = Engine(config, tp)
        executor = TensorParallelExecutor(engine, keepalive_s=15)
    else:
        engine = Engine(config)
        executor = LocalExecutor(engine)
    scheduler = Scheduler(SchedulerConfig(max_extend_tokens=16384), executor, num_pages=engine.num_pages,
                          page_size=engine.page_size, max_running_reqs=max(args.batch),
                          max_seq_len=engine.max_seq_len, eos_ids={ARCHS[args.arch]["eos_token_id"]},
                          on_output=lambda deltas: None)
    rank0 = Rank0(engine, scheduler)
    for batch in args.batch:
        measure(rank0, batch, args.prompt_len, 64, seed=100)  # warm-up
        engine.step_timer = timer = StepTimer()
        out[batch] = {"batch": batch, **measure(rank0, batch, args.prompt_len, args.output_len, seed=0),
                      **timer.decode_summary()}
        engine.step_timer = None
    executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-8b")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder, address = model_folder(args.arch), free_address("127.0.0.1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(args, folder, address, out), nprocs=args.tp_size, join=True)
        rows = [dict(out[b]) for b in args.batch]
    print(f"{'arch':>10} {'tp':>3} {'batch':>6} {'ms/token':>9} {'tok/s':>8} {'GPU step ms':>12} {'idle %':>7}")
    for r in rows:
        print(f"{args.arch:>10} {args.tp_size:>3} {r['batch']:>6} {r['ms_per_token']:>9.3f} {r['decode_tok_per_s']:>8.0f} "
              f"{r.get('decode_step_ms_median', float('nan')):>12.3f} {r.get('idle_pct_of_step_median', float('nan')):>7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "tp_size": args.tp_size, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
