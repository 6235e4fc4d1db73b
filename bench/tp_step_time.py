"""Decode steps of a tensor-parallel replica timed on the GPU: the ranks are plain processes (no Ray),
rank 0 runs the scheduler with the tensor-parallel executor and CUDA events around every step, the
other ranks run the follower loop. Per batch size: ms per output token, rank 0's GPU time per decode
step, and its idle time between steps (waiting for the host, or for a peer inside an all-reduce).
`--tp-size 1` runs the same harness on one GPU, for a side-by-side ratio.

    python bench/tp_step_time.py --arch qwen3-8b --tp-size 2 --batch 64 1 [--out r.json]
    python bench/tp_step_time.py --arch tiny --device cpu --tp-size 2 --batch 4 1   # a CPU smoke run

It cannot hang silently: every rank prints each phase it enters (to stderr, with the seconds since
start) and counts its steps in shared memory; when no rank has moved on for --timeout-s, the parent
prints each rank's phase and step count, has every rank dump its threads' Python stacks
(faulthandler), ends them and exits with code 124. --inject-stall RANK:STEP stalls one rank at
that step, to see it happen.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import signal
import sys
import time

import torch
import torch.multiprocessing as mp
from common import ARCHS, StepTimer, model_folder
from decode_latency import measure

from cluster.config import SchedulerConfig
from cluster.messages import AddRequest
from cluster.replica.engine_executors import LocalExecutor, TensorParallelExecutor
from cluster.scheduler.scheduler import Scheduler
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


class Progress:
    """What each rank is doing, in memory shared with the parent: its phase (an index into PHASES), the
    batch size it is on and the steps its engine has launched. Writing it costs a rank nothing that
    shows in the figures (no lock, no message)."""

    PHASES = (
        "importing",
        "joining the group",
        "loading the engine",
        "warming up",
        "measuring",
        "running the follower loop",
        "shutting down",
        "done",
    )

    def __init__(self, ranks: int) -> None:
        self.cells = mp.get_context("spawn").RawArray("q", 3 * ranks)
        self.start = time.monotonic()

    def enter(self, rank: int, phase: str, batch: int = 0) -> None:
        self.cells[3 * rank], self.cells[3 * rank + 1] = self.PHASES.index(phase), batch
        print(
            f"[rank {rank} +{time.monotonic() - self.start:.1f}s] {phase}" + (f" (batch {batch})" if batch else ""),
            file=sys.stderr,
            flush=True,
        )

    def count_steps(self, rank: int, engine: Engine, stall_at: int | None) -> None:
        """Counts the engine's launches (wrapping its forward); stall_at: hang at that launch."""
        forward = engine.forward

        def counted(desc):
            if self.cells[3 * rank + 2] == stall_at:
                time.sleep(1e9)  # the injected stall (--inject-stall)
            out = forward(desc)
            self.cells[3 * rank + 2] += 1
            return out

        engine.forward = counted

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.cells)

    def describe(self, rank: int) -> str:
        phase, batch, steps = self.cells[3 * rank : 3 * rank + 3]
        return f"{self.PHASES[phase]}" + (f" (batch {batch})" if batch else "") + f", {steps} steps launched"


def rank_main(rank: int, args, folder: str, address: str, out: dict, progress: Progress) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on a hang
    if args.device == "cuda":  # one visible GPU per rank, as Ray gives each rank of a replica
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    config = EngineConfig(
        model_path=folder,
        dtype="bfloat16",
        load_format="dummy",
        page_size=args.page_size,
        max_running_reqs=max(args.batch),
        device=args.device,
    )
    stall_rank, stall_step = args.inject_stall or (None, None)
    stall_at = stall_step if stall_rank == rank else None
    if rank > 0:
        progress.enter(rank, "loading the engine")  # joining the group first, in Follower.start
        follower = Follower(config, rank, args.tp_size, address, 60)
        follower.start()
        progress.count_steps(rank, follower.engine, stall_at)
        progress.enter(rank, "running the follower loop")
        follower.run()
        progress.enter(rank, "done")
        return
    if args.tp_size > 1:
        progress.enter(rank, "joining the group")
        tp = init_tensor_parallel(0, args.tp_size, address, torch.device(args.device), 60)
        progress.enter(rank, "loading the engine")
        engine = Engine(config, tp)
        executor = TensorParallelExecutor(engine, keepalive_s=15)
    else:
        progress.enter(rank, "loading the engine")
        engine = Engine(config)
        executor = LocalExecutor(engine)
    progress.count_steps(rank, engine, stall_at)
    scheduler = Scheduler(
        SchedulerConfig(max_extend_tokens=16384),
        executor,
        num_pages=engine.num_pages,
        page_size=engine.page_size,
        max_running_reqs=max(args.batch),
        max_seq_len=engine.max_seq_len,
        eos_ids={ARCHS[args.arch]["eos_token_id"]},
        on_output=lambda deltas: None,
    )
    rank0 = Rank0(engine, scheduler)
    for batch in args.batch:
        progress.enter(rank, "warming up", batch)
        measure(rank0, batch, args.prompt_len, 64, seed=100)
        progress.enter(rank, "measuring", batch)
        engine.step_timer = timer = StepTimer()
        out[batch] = {
            "batch": batch,
            **measure(rank0, batch, args.prompt_len, args.output_len, seed=0),
            **timer.decode_summary(),
        }
        engine.step_timer = None
    progress.enter(rank, "shutting down")
    executor.shutdown()
    progress.enter(rank, "done")


def run_ranks(args, folder: str, address: str, out: dict) -> None:
    """Runs every rank; exits with 124 once no rank has moved on for args.timeout_s, after saying
    where each was."""
    progress = Progress(args.tp_size)
    context = mp.spawn(rank_main, args=(args, folder, address, out, progress), nprocs=args.tp_size, join=False)
    seen, since = progress.snapshot(), time.monotonic()
    while not context.join(timeout=1.0):
        # importing and loading take a while on a loaded host: the start-up phases get their own limit
        starting = any(phase < Progress.PHASES.index("warming up") for phase in seen[0::3])
        limit = max(args.timeout_s, args.startup_timeout_s) if starting else args.timeout_s
        if (now := progress.snapshot()) != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > limit:
            report_hang(context, progress, limit)
            sys.exit(124)


def report_hang(context, progress: Progress, timeout_s: float) -> None:
    print(f"tp_step_time: no rank has moved on for {timeout_s:.0f} s; what each was doing:", file=sys.stderr)
    for rank, proc in enumerate(context.processes):
        state = "running" if proc.is_alive() else f"exited with code {proc.exitcode}"
        print(f"  rank {rank} (pid {proc.pid}, {state}): {progress.describe(rank)}", file=sys.stderr)
    for rank, proc in enumerate(context.processes):
        if proc.is_alive() and progress.cells[3 * rank] > 0:  # past its imports: its fault handler is set
            print(f"--- rank {rank}: Python stacks of every thread ---", file=sys.stderr, flush=True)
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)  # its dump reaches stderr before the next rank's
    for proc in context.processes:
        proc.kill()
        proc.join(10)


def stall(value: str) -> tuple[int, int]:
    rank, step = value.split(":")
    return int(rank), int(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-8b")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=180.0,
        help="seconds without any rank moving on (a phase begun, a step launched) before the run "
        "counts as hung; raise it for a cold FlashInfer JIT cache",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=120.0,
        help="the same limit while some rank is still importing, joining or loading",
    )
    parser.add_argument(
        "--inject-stall",
        type=stall,
        metavar="RANK:STEP",
        help="rank RANK hangs before its engine's launch STEP (from 0, once the engine is built)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder, address = model_folder(args.arch), free_address("127.0.0.1")
    with mp.Manager() as manager:
        out = manager.dict()
        run_ranks(args, folder, address, out)
        rows = [dict(out[b]) for b in args.batch]
    print(f"{'arch':>10} {'tp':>3} {'batch':>6} {'ms/token':>9} {'tok/s':>8} {'GPU step ms':>12} {'idle %':>7}")
    for r in rows:
        print(
            f"{args.arch:>10} {args.tp_size:>3} {r['batch']:>6} {r['ms_per_token']:>9.3f} {r['decode_tok_per_s']:>8.0f} "
            f"{r.get('decode_step_ms_median', float('nan')):>12.3f} {r.get('idle_pct_of_step_median', float('nan')):>7.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "tp_size": args.tp_size, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
