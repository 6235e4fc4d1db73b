"""CPU time per scheduler step with a stand-in engine that does no model work: scheduling, building
the batch description and handling results, at several batch sizes, normal and overlap loops.

    python bench/scheduler_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cluster.config import SchedulerConfig
from cluster.sampling_params import SamplingParams
from cluster.scheduler import Scheduler
from worker.batch import BatchDesc, StepOutput
from worker.stream import NullEvent


class NullEngine:
    """Returns a fixed token for every request at once, like an infinitely fast GPU."""

    def launch(self, desc: BatchDesc) -> StepOutput:
        return StepOutput(next_tokens=np.full(desc.batch_size, 7, dtype=np.int32), done=NullEvent())

    def wait(self, out: StepOutput) -> None:
        pass


def measure(batch: int, overlap: bool, steps: int = 300) -> float:
    engine = NullEngine()
    sched = Scheduler(SchedulerConfig(overlap=overlap), engine, num_pages=batch * 2304 // 16, page_size=16,
                      max_running_reqs=batch, max_seq_len=4096, eos_ids={0}, on_output=lambda deltas: None)
    params = SamplingParams(temperature=0.6, max_tokens=2048, ignore_eos=True)
    for uid in range(batch):
        sched.submit(uid, list(range(1, 129)), params)
    while len(sched.running) < batch:  # admit and prefill everything first
        sched.step()
    for _ in range(5):
        sched.step()
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'batch':>6} {'loop':>8} {'us/step':>10} {'us/request':>11}")
    for batch in (1, 64, 256):
        for overlap in (False, True):
            t = measure(batch, overlap)
            rows.append({"batch": batch, "overlap": overlap, "us_per_step": t * 1e6})
            print(f"{batch:>6} {'overlap' if overlap else 'normal':>8} {t * 1e6:>10.1f} {t * 1e6 / batch:>11.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
