"""CPU time per scheduler step over a scripted executor that does no model work (tests/scripted.py):
scheduling, building the batch description and handling results, at several batch sizes, normal and
overlap loops.

    python bench/scheduler_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from scripted import scripted_scheduler  # noqa: E402


def measure(batch: int, overlap: bool, steps: int = 300) -> float:
    run = scripted_scheduler(
        num_pages=batch * 2304 // 16,
        page_size=16,
        max_running_reqs=batch,
        max_seq_len=4096,
        overlap=overlap,
        keep_deltas=False,
    )
    sched = run.scheduler
    for uid in range(batch):
        run.submit(uid, list(range(1, 129)), max_tokens=2048, temperature=0.6, ignore_eos=True)
    while len(sched.decode.running) < batch:  # admit and prefill everything first
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
