"""How many requests run at once when clients leave max_tokens unset (the OpenAI chat default: up to
the context), under the KV budget of a real deployment. A stand-in engine with no model work ends
each request at a random length; the figures are scheduling decisions, not GPU time.

Compares reserving KV for all of max_tokens at admission (`--reserve` of the context length) with
reserving a bounded amount and preempting requests that outgrow it (the default, 1024 tokens).

    python bench/admission_capacity.py [--pages 43750] [--requests 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np

from cluster.config import SchedulerConfig
from cluster.sampling_params import SamplingParams
from cluster.scheduler import Scheduler
from worker.batch import BatchDesc, StepOutput
from worker.stream import NullEvent

EOS = 0


class RandomLengthEngine:
    """Samples EOS with probability 1/mean_len per token (a geometric output length), else token 7."""

    def __init__(self, mean_len: int, seed: int) -> None:
        self.p, self.rng = 1.0 / mean_len, random.Random(seed)

    def launch(self, desc: BatchDesc) -> StepOutput:
        ids = [EOS if self.rng.random() < self.p else 7 for _ in range(desc.batch_size)]
        return StepOutput(next_tokens=np.asarray(ids, dtype=np.int32), done=NullEvent())

    def wait(self, out: StepOutput) -> None:
        pass


def run(reserve: int, args) -> dict:
    sched = Scheduler(SchedulerConfig(decode_reserve_tokens=reserve), RandomLengthEngine(args.mean_output, 0),
                      num_pages=args.pages, page_size=16, max_running_reqs=256, max_seq_len=args.context,
                      eos_ids={EOS}, on_output=lambda deltas: None)
    params = SamplingParams(temperature=0.6, max_tokens=None)
    rng = random.Random(1)
    for uid in range(args.requests):
        sched.submit(uid, [rng.randrange(1, 50_000) for _ in range(args.prompt)], params)
    decode_steps, batches = 0, []
    while sched.has_work:
        sched.step()
        if sched.in_flight is not None and not sched.in_flight.desc.is_prefill:
            decode_steps += 1
            batches.append(sched.in_flight.desc.batch_size)
    sched.check_integrity()
    return {"reserve_tokens": reserve, "decode_steps": decode_steps, "peak_batch": max(batches),
            "mean_batch": round(sum(batches) / len(batches), 1), "preempted": sched.stats["preempted"],
            "prefill_tokens": sched.stats["prefill_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=43_750, help="KV pages of 16 tokens (default: 700k tokens, "
                    "about what Qwen3-8B leaves on one H200 at 0.85 memory utilization)")
    ap.add_argument("--context", type=int, default=40_960)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--mean-output", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [run(args.context, args), run(1024, args)]
    print(f"{'reserved tokens':>16} {'decode steps':>13} {'peak batch':>11} {'mean batch':>11} {'preempted':>10} "
          f"{'prefill tokens':>15}")
    for r in rows:
        print(f"{r['reserve_tokens']:>16} {r['decode_steps']:>13} {r['peak_batch']:>11} {r['mean_batch']:>11} "
              f"{r['preempted']:>10} {r['prefill_tokens']:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
