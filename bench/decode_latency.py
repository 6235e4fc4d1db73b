"""Decode latency: one request (a 32-token prompt, 512 output tokens, temperature 0.6, ignore_eos) on
Qwen3-0.6B's architecture with random weights; milliseconds per output token, prefill excluded (the
time from the first token to the last, over 511). With --batch N, N such requests decode together
and the decode throughput (tokens per second) is reported too.

    python bench/decode_latency.py [--out r.json] [--batch N] [--arch qwen3-8b] [--no-overlap]
                                   [--no-cuda-graph] [--cache naive]"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
from common import (
    ARCHS,
    ProfileWindow,
    Sections,
    StepTimer,
    add_common_args,
    config_of,
    make_llm,
    report,
    resolved_kernels,
    token_arrivals,
)

from cluster import LLM, SamplingParams


def measure_wall(llm: LLM, batch: int, prompt_len: int, output_len: int, seed: int, vocab: int) -> dict:
    """Through a tensor-parallel replica (its scheduler is a Ray actor): decode time is the time of the
    whole generation less that of the same prompts with one output token (the prefill)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=prompt_len).tolist() for _ in range(batch)]
    params = lambda n: SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=seed)  # noqa: E731
    start = time.perf_counter()
    llm.generate(prompts, params(1))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, params(output_len))
    decode = time.perf_counter() - start - prefill
    return {"ms_per_token": 1e3 * decode / (output_len - 1), "decode_tok_per_s": batch * (output_len - 1) / decode}


def measure(llm: LLM, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, llm.engine.hf_config.vocab_size, size=prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True, seed=seed)
    times = list(token_arrivals(llm, prompts, params).arrivals.values())  # each request's token times
    per_token_ms = [1e3 * (t[-1] - t[0]) / (len(t) - 1) for t in times]
    start, end = max(t[0] for t in times), max(t[-1] for t in times)  # every request decoding
    decoded = sum(sum(1 for x in t if x > start) for t in times)
    return {"ms_per_token": statistics.median(per_token_ms), "decode_tok_per_s": decoded / (end - start)}


def run_batch(llm: LLM, args, batch: int) -> dict:
    runs = []
    if args.tp_size > 1 or args.wall_clock:
        vocab = ARCHS[args.arch]["vocab_size"]
        measure_wall(llm, batch, args.prompt_len, 64, 100, vocab)  # warm-up
        runs = [measure_wall(llm, batch, args.prompt_len, args.output_len, i, vocab) for i in range(args.repeats)]
    else:
        # warm-up over the whole length the runs reach: what a first visit to those positions costs lands here
        measure(llm, batch, args.prompt_len, args.output_len, seed=100)
    for i in range(args.repeats if not runs else 0):
        llm.engine.step_timer = timer = StepTimer()
        with HostTimer(llm.engine) as host, GcPauses() as pauses:
            r = measure(llm, batch, args.prompt_len, args.output_len, seed=i)
        runs.append({**r, **timer.decode_summary(), **host.summary(), **pauses.summary()})
        llm.engine.step_timer = None
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if not (args.tp_size > 1 or args.wall_clock):
        median["host_sections"] = host_sections(llm, batch, args)
    if getattr(args, "profile", False) and not args.wall_clock and args.tp_size == 1:
        llm.engine.step_timer = window = ProfileWindow(first=200, count=50, trace=getattr(args, "trace", None))
        measure(llm, batch, args.prompt_len, args.output_len, seed=0)
        llm.engine.step_timer = None
        median["profile"] = window.top_kernels(40)
    return {
        "benchmark": "decode_latency",
        **config_of(args),
        **resolved_kernels(llm),
        "batch": batch,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        **median,
        "runs": runs,
    }


def host_sections(llm: LLM, batch: int, args) -> dict:
    """One more run with the host's main parts of a step timed (microseconds per step, each wrapped
    method's wall time, waits included; nested parts count in their parents too)."""
    engine, sched = llm.engine, llm.scheduler
    sections = Sections()
    sections.add("scheduler.schedule", sched, "schedule")
    sections.add("scheduler._emit_tokens (waits for the step)", sched, "_emit_tokens")
    sections.add("scheduler.receive", sched, "receive")
    sections.add("builder.decode", sched.builder, "decode")
    sections.add("engine.forward", engine, "forward")
    sections.add("engine._stage", engine, "_stage")
    sections.add("engine.staging.upload", engine.staging, "upload")
    sections.add("engine._replay", engine, "_replay")
    sections.add("engine._to_host", engine, "_to_host")
    if engine.graphs is not None:
        sections.add("graphs.prepare (attention plan)", engine.graphs, "prepare")
        sections.add("graphs.replay", engine.graphs, "replay")
    attn = engine.attn
    sections.add("attn._plan", attn, "_plan")
    sections.add("attn._gather_page_ids", attn, "_gather_page_ids")
    sections.add("attn.staging.upload", getattr(attn, "staging", None), "upload")
    for wrapper in getattr(attn, "graph_wrappers", {}).values():
        sections.add("flashinfer plan (graph wrappers)", wrapper, "plan")
    waited = engine.host_waits.seconds
    try:
        start = time.perf_counter()
        measure(llm, batch, args.prompt_len, args.output_len, seed=0)
        wall = time.perf_counter() - start
    finally:
        sections.remove()
    steps = args.output_len  # about one step per token
    out = sections.summary(steps)
    out["host waits on device events"] = {"us_per_step": 1e6 * (engine.host_waits.seconds - waited) / steps}
    out["run wall"] = {"us_per_step": 1e6 * wall / steps}
    return out


class GcPauses:
    """The garbage collector's pauses during a run (gc.callbacks): how many collections of each generation,
    and the host time they took, in all and the longest."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        return {
            **{f"gc_gen{n}_collections": sum(g == n for g, _ in self.pauses) for n in range(3)},
            "gc_pause_ms_total": 1e3 * sum(t for _, t in self.pauses),
            "gc_pause_ms_max": 1e3 * max((t for _, t in self.pauses), default=0.0),
        }


class HostTimer:
    """Host time of each decode step's Engine.forward (staging, planning, launches: what the host spends
    on a step besides the scheduler's own work), by wrapping the method; and the host's own work per
    step over the whole run: its wall time less the time it was blocked on device events
    (the engine's host_waits: the previous step's result, a staging slot, FlashInfer's plan copy)."""

    def __init__(self, engine) -> None:
        self.engine, self.times, self.work = engine, [], []
        self.decode_steps = 0

    def __enter__(self) -> HostTimer:
        forward = self.engine.forward

        def timed(desc):
            start, waited = time.perf_counter(), self.engine.host_waits.seconds
            out = forward(desc)
            if not desc.is_prefill:
                took = time.perf_counter() - start
                self.times.append(took)
                self.work.append(took - (self.engine.host_waits.seconds - waited))
                self.decode_steps += 1
            return out

        self.engine.forward = timed
        self._start, self._waited = time.perf_counter(), self.engine.host_waits.seconds
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.forward  # the class's method again
        self._wall = time.perf_counter() - self._start
        self._blocked = self.engine.host_waits.seconds - self._waited

    def summary(self) -> dict:
        if not self.times:
            return {}
        return {
            "host_forward_ms_median": 1e3 * statistics.median(self.times),
            "host_forward_ms_p90": 1e3 * sorted(self.times)[int(0.9 * len(self.times))],
            # Engine.forward less its waits; then every host thread's work per decode step (the
            # scheduler's too), the prefill's counted in
            "host_forward_work_ms_median": 1e3 * statistics.median(self.work),
            "host_work_ms_per_step": 1e3 * (self._wall - self._blocked) / self.decode_steps,
        }


def table_rows(args, r: dict) -> list[tuple[str, object]]:
    return [
        ("arch", args.arch),
        ("tp", args.tp_size),
        ("batch", r["batch"]),
        ("overlap", not args.no_overlap),
        ("cuda graphs", not args.no_cuda_graph),
        ("ms per output token (median)", r["ms_per_token"]),
        ("decode tok/s", r["decode_tok_per_s"]),
        ("GPU decode step ms (median)", r.get("decode_step_ms_median", float("nan"))),
        ("idle between decode steps % (median)", r.get("idle_pct_of_step_median", float("nan"))),
        (
            "GC collections (generations 0/1/2) per run",
            " ".join("/".join(str(x.get(f"gc_gen{n}_collections", "-")) for n in range(3)) for x in r["runs"]),
        ),
        (
            "GC pause ms per run (total, longest)",
            " ".join(
                f"{x.get('gc_pause_ms_total', float('nan')):.1f},{x.get('gc_pause_ms_max', float('nan')):.1f}"
                for x in r["runs"]
            ),
        ),
        ("idle % per run", " ".join(f"{x.get('idle_pct_of_step_total', float('nan')):.2f}" for x in r["runs"])),
        (
            "steps the host launched late % per run",
            " ".join(f"{x.get('host_late_pct_of_steps', float('nan')):.1f}" for x in r["runs"]),
        ),
        (
            "share of idle after late launches % per run",
            " ".join(f"{x.get('idle_pct_host_late', float('nan')):.1f}" for x in r["runs"]),
        ),
        ("scheduler stream's part of a step ms (median)", r.get("sched_part_ms_median", float("nan"))),
        (
            "  its start after the step before ended ms (median)",
            r.get("sched_part_start_after_step_end_ms_median", float("nan")),
        ),
        (
            "  its end after the step before ended ms (median)",
            r.get("sched_part_end_after_step_end_ms_median", float("nan")),
        ),
        ("ms per token per run", " ".join(f"{x['ms_per_token']:.3f}" for x in r["runs"])),
        (
            "host Engine.forward work ms per decode step (median, waits excluded)",
            r.get("host_forward_work_ms_median", float("nan")),
        ),
        (
            "host work ms per decode step (the scheduler's too, waits excluded)",
            r.get("host_work_ms_per_step", float("nan")),
        ),
        ("host Engine.forward ms per decode step (median)", r.get("host_forward_ms_median", float("nan"))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="one or more batch sizes, run in turn")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wall-clock", action="store_true", help="time as for tp > 1 (whole generations)")
    parser.add_argument("--profile", action="store_true", help="then profile the kernels of decode steps 200-249")
    parser.add_argument(
        "--trace",
        help="with --profile: write that window's host and device timeline here "
        "(Chrome trace JSON; .json.gz to compress)",
    )
    args = parser.parse_args()
    llm = make_llm(args)
    results = [run_batch(llm, args, batch) for batch in args.batch]
    report(
        results[0] if len(results) == 1 else {"benchmark": "decode_latency", "results": results},
        args.out,
        [row for r in results for row in table_rows(args, r)],
    )
    for r in results:
        for name, v in r.get("host_sections", {}).items():
            print(f"  host {v['us_per_step']:8.1f} us/step  {v.get('calls_per_step', 0):5.2f} calls/step  {name}")
        for row in r.get("profile", []):
            print(f"  {row['pct']:5.1f}%  {row['ms']:8.3f} ms  {row['calls']:6d}  {row['kernel']}")
    llm.shutdown()


if __name__ == "__main__":
    main()
