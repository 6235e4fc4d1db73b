"""Running decodes while long prompts arrive, mixed steps against prefill-first, side by side: 32 decode
streams (64-token prompts, 512 new tokens each) and, once they all decode, a long prompt (8192 tokens,
16 new) arriving every 40 steps, 6 in all; prefill chunks of 2048 tokens (--chunk).

    python bench/mixed_steps.py [--out r.json] [--arch tiny]       # the model on this machine's device
    python bench/mixed_steps.py --scripted                          # the scheduler alone (no model)
Per mode: the decode streams' inter-token latency (median, p99), their longest stall (the most steps,
and with a model the longest time, between two tokens of one stream), the long prompts' TTFT, and the
output throughput. --scripted counts in steps only (an executor that samples at once)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import add_common_args, config_of, model_folder, report  # noqa: E402
from scripted import scripted_scheduler  # noqa: E402

from cluster import LLM, AddRequest, SamplingParams  # noqa: E402

STREAMS, LONG, EVERY, NUM_LONG = 32, 8192, 40, 6


def drive(scheduler, vocab: int, seed: int) -> tuple[dict[int, list[tuple[int, float]]], dict[int, float]]:
    """Runs the workload on a scheduler; returns each request's (step, time) per token and the long
    prompts' arrival times."""
    rng = np.random.default_rng(seed)
    seen: dict[int, list[tuple[int, float]]] = {}
    step = [0]
    inner = scheduler.on_output

    def on_output(deltas):
        now = time.perf_counter()
        for d in deltas:
            if d.token is not None:
                seen.setdefault(d.uid, []).append((step[0], now))
        inner(deltas)

    scheduler.on_output = on_output
    for uid in range(STREAMS):
        scheduler.submit(
            AddRequest(
                uid,
                rng.integers(0, vocab, 64).tolist(),
                SamplingParams(temperature=0.6, max_tokens=512, ignore_eos=True, seed=uid),
            )
        )
    while len(seen) < STREAMS:
        scheduler.step()
        step[0] += 1
    arrivals: dict[int, float] = {}
    start = step[0]
    while scheduler.has_work or len(arrivals) < NUM_LONG:
        k = (step[0] - start) // EVERY
        if k < NUM_LONG and (step[0] - start) % EVERY == 0 and 1000 + k not in arrivals:
            arrivals[1000 + k] = time.perf_counter()
            scheduler.submit(
                AddRequest(
                    1000 + k,
                    rng.integers(0, vocab, LONG).tolist(),
                    SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, seed=k),
                )
            )
        scheduler.step()
        step[0] += 1
    return seen, arrivals


def summarize(seen, arrivals, elapsed: float | None) -> dict:
    gaps_steps, gaps_ms = [], []
    for uid in range(STREAMS):
        tokens = seen[uid]
        gaps_steps += [b[0] - a[0] for a, b in zip(tokens, tokens[1:])]
        gaps_ms += [(b[1] - a[1]) * 1e3 for a, b in zip(tokens, tokens[1:])]
    out = {
        "longest_stall_steps": max(gaps_steps) - 1,  # steps without a token (1 apart is no stall)
        "streams_gaps_over_one_step": sum(g > 1 for g in gaps_steps),
    }
    if elapsed is not None:
        ttft = [(seen[uid][0][1] - t) * 1e3 for uid, t in arrivals.items()]
        out.update(
            itl_ms_median=statistics.median(gaps_ms),
            itl_ms_p99=float(np.percentile(gaps_ms, 99)),
            longest_stall_ms=max(gaps_ms),
            long_prompt_ttft_ms_median=statistics.median(ttft),
            long_prompt_ttft_ms_max=max(ttft),
            output_tok_per_s=sum(len(v) for v in seen.values()) / elapsed,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--scripted", action="store_true", help="the scheduler over an executor with no model")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = {}
    for mixed in (True, False):
        if args.scripted:
            run = scripted_scheduler(
                num_pages=(STREAMS * 640 + NUM_LONG * LONG) // 16,
                page_size=16,
                max_running_reqs=64,
                max_seq_len=LONG + 64,
                keep_deltas=False,
                max_extend_tokens=args.chunk,
                mixed_steps=mixed,
                overlap=not args.no_overlap,
            )
            seen, arrivals = drive(run.scheduler, 1000, args.seed)
            runs["mixed" if mixed else "prefill_first"] = summarize(seen, arrivals, None)
            continue
        llm = LLM(
            model_folder(args.arch),
            dtype="bfloat16",
            load_format="dummy",
            page_size=args.page_size,
            max_extend_tokens=args.chunk,
            max_running_reqs=args.max_running_reqs,
            mixed_steps=mixed,
            overlap=not args.no_overlap,
            cuda_graph_max_bs=0 if args.no_cuda_graph else 256,
        )
        vocab = llm.engine.hf_config.vocab_size
        llm.generate([[1] * LONG, [2] * 64], SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        seen, arrivals = drive(llm.scheduler, vocab, args.seed)
        runs["mixed" if mixed else "prefill_first"] = summarize(seen, arrivals, time.perf_counter() - start)
        llm.shutdown()
        del llm  # the next mode's engine sizes its KV cache from the memory this one frees
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {
        "benchmark": "mixed_steps",
        **config_of(args),
        "scripted": args.scripted,
        "chunk": args.chunk,
        "runs": runs,
    }
    report(
        result,
        args.out,
        [
            (mode, ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
            for mode, r in runs.items()
        ],
    )


if __name__ == "__main__":
    main()
