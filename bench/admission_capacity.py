"""How many requests run at once when clients leave max_tokens unset (the OpenAI chat default: up to
the context), under the KV budget of a real deployment. A scripted executor with no model work
(tests/scripted.py) ends each request at a random length; the figures are scheduling decisions, not
GPU time.

Compares reserving KV for all of max_tokens at admission (`--reserve` of the context length) with
reserving a bounded amount and preempting requests that outgrow it (the default, 1024 tokens).

    python bench/admission_capacity.py [--pages 43750] [--requests 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from scripted import eos_with_probability, scripted_scheduler  # noqa: E402


def run(reserve: int, args) -> dict:
    scripted = scripted_scheduler(
        eos_with_probability(1.0 / args.mean_output, seed=0),
        num_pages=args.pages,
        page_size=16,
        max_running_reqs=256,
        max_seq_len=args.context,
        decode_reserve_tokens=reserve,
        keep_deltas=False,
    )
    rng = random.Random(1)
    for uid in range(args.requests):
        scripted.submit(uid, [rng.randrange(1, 50_000) for _ in range(args.prompt)], max_tokens=None, temperature=0.6)
    scripted.run(max_steps=10**7)
    scripted.scheduler.check_integrity()
    batches = [desc.batch_size for desc in scripted.executor.launched if not desc.is_prefill]
    stats = scripted.scheduler.snapshot()
    return {
        "reserve_tokens": reserve,
        "decode_steps": len(batches),
        "peak_batch": max(batches),
        "mean_batch": round(sum(batches) / len(batches), 1),
        "preempted": stats.preempted,
        "prefill_tokens": stats.prefill_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pages",
        type=int,
        default=43_750,
        help="KV pages of 16 tokens (default: 700k tokens, "
        "about what Qwen3-8B leaves on one H200 at 0.85 memory utilization)",
    )
    ap.add_argument("--context", type=int, default=40_960)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--mean-output", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [run(args.context, args), run(1024, args)]
    print(
        f"{'reserved tokens':>16} {'decode steps':>13} {'peak batch':>11} {'mean batch':>11} {'preempted':>10} "
        f"{'prefill tokens':>15}"
    )
    for r in rows:
        print(
            f"{r['reserve_tokens']:>16} {r['decode_steps']:>13} {r['peak_batch']:>11} {r['mean_batch']:>11} "
            f"{r['preempted']:>10} {r['prefill_tokens']:>15}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
