"""What one prompt's eager extend step costs the host and the device, TTFT's step at low load: for
one-token generations of prompts at several lengths, greedy and seeded at temperature 0.6, the host time
of the step's launch, the device time still to run once the launch returns (a synchronize right after
it), and under torch's profiler the CUDA calls that block the host (synchronizes, copies to the host)
with the host ops that take the most time of their own.

    python bench/prefill_launch.py [--arch qwen3-0.6b] [--lens 128 512 1024] [--prompts 12] [--out r.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
from common import ARCHS, add_common_args, make_llm, report

from cluster import SamplingParams

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "aten::item")


def timed_launches(sched, prof: cProfile.Profile | None = None) -> list[tuple[float, float]]:
    """(host launch ms, device ms after it) of each prefill step: wraps the scheduler's launch. `prof`,
    when given, is enabled around the prefill launches alone."""
    marks: list[tuple[float, float]] = []
    launch = sched._launch

    def timed(batch):
        on = prof is not None and batch.desc.is_prefill
        if on:
            prof.enable()
        t0 = time.perf_counter()
        out = launch(batch)
        t1 = time.perf_counter()
        if on:
            prof.disable()
        if batch.desc.is_prefill:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
        return out

    sched._launch = timed
    return marks


def profile_table(llm, prompts: list[list[int]], params: SamplingParams, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for q in prompts:
            llm.generate([q], params)
    n = len(prompts)
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    blocking = [e for e in events if any(b in e.key for b in BLOCKING)]
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(
        f"--- profiled {n} generations: kernels {device_us / n / 1e3:.3f} ms, {launches / n:.0f} launches a generation"
    )
    print(
        "  blocking calls (a generation): "
        + ", ".join(f"{e.key} {e.count / n:.1f}x {e.cpu_time_total / n / 1e3:.3f} ms" for e in blocking)
    )
    for e in rows:
        print(f"  {e.self_cpu_time_total / n / 1e3:8.3f} ms own {e.count / n:7.1f} calls  {e.key}")
    return {
        "kernel_ms": device_us / n / 1e3,
        "launches": launches / n,
        "blocking": {e.key: [e.count / n, e.cpu_time_total / n / 1e3] for e in blocking},
        "top_own_ms": {e.key: e.self_cpu_time_total / n / 1e3 for e in rows},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--lens", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--prompts", type=int, default=12, help="generations a length and sampling")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    vocab = ARCHS[args.arch]["vocab_size"]
    draws = {
        "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        "seeded": lambda i: SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=i),
    }
    result: dict = {"args": vars(args), "rows": {}}
    with make_llm(args) as llm:
        marks_launch = llm.scheduler._launch
        marks = timed_launches(llm.scheduler)
        llm.generate([rng.integers(0, vocab, size=256).tolist() for _ in range(4)], draws["greedy"](0))  # warm-up
        for n in args.lens:
            for name, draw in draws.items():
                prompts = [rng.integers(0, vocab, size=n).tolist() for _ in range(args.prompts)]
                marks.clear()
                t0 = time.perf_counter()
                for i, q in enumerate(prompts):
                    llm.generate([q], draw(i))
                wall = (time.perf_counter() - t0) * 1e3 / len(prompts)
                host = statistics.fmean(m[0] for m in marks)
                dev = statistics.fmean(m[1] for m in marks)
                key = f"{n}_{name}"
                result["rows"][key] = {"generation_ms": wall, "launch_ms": host, "device_after_ms": dev}
                print(f"{key:14} generation {wall:7.3f} ms  launch {host:7.3f} ms  device after it {dev:6.3f} ms")
        n = args.lens[len(args.lens) // 2]
        prof = cProfile.Profile()
        llm.scheduler._launch = marks_launch
        timed_launches(llm.scheduler, prof)
        for i in range(6):
            llm.generate([rng.integers(0, vocab, size=n).tolist()], draws["seeded"](i))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
        text.write("\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"=== {n}-token prompts, seeded, the prefill launches under cProfile (6 of them)")
        print(text.getvalue())
        prompts = [rng.integers(0, vocab, size=n).tolist() for _ in range(6)]
        print(f"=== {n}-token prompts, seeded, under torch's profiler")
        result["profile"] = profile_table(llm, prompts, draws["seeded"](1), args.top)
    figures = [(f"{k} launch ms", v["launch_ms"]) for k, v in result["rows"].items()]
    report(result, args.out, figures)


if __name__ == "__main__":
    main()
