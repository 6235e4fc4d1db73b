"""Where the online time to first token goes at concurrency 1: the HTTP TTFT of streamed requests one
at a time beside the offline engine's on the same prompts (its first token's delta, of a generation of
the same length, and of a one-token generation), and the mean of every hop the server exports
(raylm:*_time_seconds on /metrics, router/http/hops.py).

    python bench/first_token_hops.py --model PATH [--num-prompts 48] [--output-len 16 64] [--out FILE]
    python bench/first_token_hops.py --arch qwen3-0.6b [...]   (random weights, bf16: bench/common.py)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python bench/x.py` from anywhere

import httpx  # noqa: E402
from online_serving import default_client, release_gpu_memory, run, start_server, workload  # noqa: E402

from cluster.replica.profiling import PROFILE_ENV  # noqa: E402

HOPS = (
    "router_parse",
    "router_tokenize",
    "router_submit",
    "request_transfer",
    "request_queue",
    "request_prefill",
    "request_first_sample",
    "request_first_flush",
    "router_detokenize",
    "router_first_chunk_write",
)


def offline_ttft(
    model: str,
    requests: list,
    others: list,
    page_size: int,
    load_format: str | None,
    profile: cProfile.Profile | None = None,
) -> dict:
    """The in-process engine's TTFT one prompt at a time: to its first token's delta in a generation
    of the request's own length, and to the end of a one-token generation. `others`: prompts of their own
    for the warm-up and the one-token generations, so that no measured prompt finds itself in the
    prefix cache. `profile`: enabled around the engine's generations (warm-up included), as the replica's
    scheduler thread is profiled over all it serves."""
    from cluster import LLM, SamplingParams

    opts = {"load_format": load_format} if load_format else {}
    with LLM(model, page_size=page_size, **opts) as llm:
        sched, first = llm.scheduler, {}
        emit = sched.on_output

        def stamped(deltas):
            now = time.perf_counter()
            for d in deltas:
                first.setdefault(d.uid, now)
            emit(deltas)

        sched.on_output = stamped
        marks = _timeline(sched)
        params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True, seed=len(p)) for p, m in requests]
        if profile is not None:
            profile.enable()
        llm.generate([p for p, _ in others[:8]], params[:8])  # warm-up
        streamed, one, phases = [], [], []
        for (prompt, _), p, (other, _) in zip(requests, params, others):
            first.clear()
            marks.clear()
            start = time.perf_counter()
            llm.generate([prompt], p)
            streamed.append(min(first.values()) - start)
            phases.append(_phases(marks, start, min(first.values())))
            start = time.perf_counter()
            llm.generate([other], SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=len(other)))
            one.append(time.perf_counter() - start)
        if profile is not None:
            profile.disable()
    out = {"first_delta_ms": _mean_ms(streamed), "one_token_ms": _mean_ms(one)}
    keys = dict.fromkeys(k for p in phases for k in p)  # a phase a generation lacked is left out of its mean
    out["first_delta_phases_ms"] = {k: statistics.fmean(p[k] for p in phases if k in p) for k in keys}
    return out


def compare_profiles(
    offline: cProfile.Profile | None, offline_prompts: int, replica_file: Path, replica_prompts: int, top: int
) -> list[dict]:
    """The functions with the most time of their own in either profile, as ms a prompt served in each
    (cProfile's overhead alike on both sides); printed, and returned for the report."""
    sides = {"replica": pstats.Stats(str(replica_file)).stats if replica_file.exists() else {}}
    if offline is not None and offline_prompts:
        sides["offline"] = pstats.Stats(offline).stats
    per_prompt = {"replica": replica_prompts, "offline": offline_prompts}
    names = set()
    for stats in sides.values():
        names |= set(sorted(stats, key=lambda f: stats[f][2], reverse=True)[:top])
    rows = []
    for func in names:
        file, line, name = func
        row = {"where": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})"}
        for side, stats in sides.items():
            _cc, calls, tt, ct, _ = stats.get(func, (0, 0, 0.0, 0.0, None))
            row[f"{side}_tottime_ms"] = 1e3 * tt / per_prompt[side]
            row[f"{side}_cumtime_ms"] = 1e3 * ct / per_prompt[side]
            row[f"{side}_calls"] = calls / per_prompt[side]
        rows.append(row)
    rows.sort(key=lambda r: max(r.get("replica_tottime_ms", 0.0), r.get("offline_tottime_ms", 0.0)), reverse=True)
    print(f"{'ms a prompt of their own time (calls a prompt)':60} {'replica':>18} {'offline':>18}")
    for r in rows[:top]:
        cells = [
            f"{r[f'{side}_tottime_ms']:8.3f} ({r[f'{side}_calls']:6.1f})" if f"{side}_tottime_ms" in r else ""
            for side in ("replica", "offline")
        ]
        print(f"  {r['where'][:58]:58} {cells[0]:>18} {cells[1]:>18}")
    if not replica_file.exists():
        print(f"  (no replica profile at {replica_file}: did the replica shut down in order?)")
    return rows[:top]


def _timeline(sched) -> list[tuple[str, float, float]]:
    """(what, start, end) of each step launch and each wait for a step's tokens, as the scheduler makes
    them: wraps its launch and its executor's wait."""
    marks: list[tuple[str, float, float]] = []
    launch, wait = sched._launch, sched.executor.wait

    def timed_launch(batch):
        t = time.perf_counter()
        try:
            return launch(batch)
        finally:
            marks.append(("prefill" if batch.desc.is_prefill else "decode", t, time.perf_counter()))

    def timed_wait(out):
        t = time.perf_counter()
        try:
            return wait(out)
        finally:
            marks.append(("wait", t, time.perf_counter()))

    sched._launch, sched.executor.wait = timed_launch, timed_wait
    return marks


def _phases(marks: list[tuple[str, float, float]], start: float, first: float) -> dict[str, float]:
    """Where one streamed generation's time to its first delta went, in ms: up to its prefill's launch,
    that launch, what came between it and the next step's launch, the next launch (under overlap it
    comes before the prefill's tokens are handled), the wait for the prefill's tokens, and the rest."""
    ms = 1e3
    pre = next(m for m in marks if m[0] == "prefill")
    nxt = next((m for m in marks if m[0] != "wait" and m[1] >= pre[2]), None)
    waited = next((m for m in marks if m[0] == "wait" and m[1] >= pre[2]), None)
    out = {"before_prefill_launch": (pre[1] - start) * ms, "prefill_launch": (pre[2] - pre[1]) * ms}
    if nxt is not None and nxt[2] <= first:
        out["until_next_launch"] = (nxt[1] - pre[2]) * ms
        out["next_launch"] = (nxt[2] - nxt[1]) * ms
    if waited is not None and waited[2] <= first:
        out["prefill_wait"] = (waited[2] - waited[1]) * ms
        out["after_wait"] = (first - waited[2]) * ms
    return out


def hop_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each hop's histogram, and of the TTFT's, as /metrics shows them now."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for name in (*HOPS, "time_to_first_token"):
        family = f"raylm:{name}_seconds" if name == "time_to_first_token" else f"raylm:{name}_time_seconds"
        values = [
            sum(float(v) for v in re.findall(rf"^{re.escape(family)}_{kind}{{[^}}]*}} (\S+)$", text, re.M))
            for kind in ("sum", "count")
        ]
        out[name] = (values[0], values[1])
    return out


def _mean_ms(xs: list[float]) -> float:
    return statistics.fmean(xs) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--arch", help="instead of --model: a bench architecture (random weights, bf16)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 128])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--routers", type=int, default=None)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile-replica",
        metavar="DIR",
        help="cProfile the replica's scheduler thread and the offline engine, and print where each spends its "
        "host time a prompt (the statistics files go to DIR)",
    )
    p.add_argument("--top", type=int, default=30, help="with --profile-replica: functions shown")
    p.add_argument(
        "--clients",
        nargs="+",
        choices=["aiohttp", "httpx"],
        default=list(dict.fromkeys([default_client(), "httpx"])),
        help="HTTP clients, in turn (the hops are the first's): aiohttp as SGLang's bench_serving, httpx",
    )
    p.add_argument("--out")
    args = p.parse_args()
    args.load_format = None
    if args.arch:
        from common import model_folder

        args.model, args.load_format = model_folder(args.arch, with_tokenizer=True), "dummy"
    if not args.model:
        p.error("--model or --arch is required")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    requests = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    # the warm-ups' and the one-token generations' prompts: none of them a measured one's prefix
    others = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed + 1)
    report: dict = {"args": vars(args)}
    offline_profile = cProfile.Profile() if args.profile_replica else None
    if not args.no_offline:
        report["offline"] = offline_ttft(
            args.model, requests, others, args.page_size, args.load_format, offline_profile
        )
        release_gpu_memory()
    if args.profile_replica:  # the server's replica inherits it (Ray's local workers take the driver's environment)
        Path(args.profile_replica).mkdir(parents=True, exist_ok=True)
        os.environ[PROFILE_ENV] = str(Path(args.profile_replica).resolve() / "scheduler")
    server_args = SimpleNamespace(
        model=args.model,
        tp_size=1,
        replicas=1,
        page_size=args.page_size,
        load_format=args.load_format,
        routers=args.routers,
    )
    server, url = start_server(server_args)
    try:
        run(url, "bench", others[:16], 16, client=args.clients[0])  # warm-up
        before = hop_sums(url)
        online = run(url, "bench", requests, 1, client=args.clients[0])
        after = hop_sums(url)
        # the other clients on the same prompts (a prefix-cache hit each, as the first client's were not)
        # would not compare: prompts of their own, of the same lengths
        by_client = {args.clients[0]: online["ttft"]["mean_ms"]}
        for i, client in enumerate(args.clients[1:], 1):
            rng = random.Random(args.seed + 10 + i)
            again = [([rng.randrange(100, vocab - 100) for _ in p], m) for p, m in requests]
            by_client[client] = run(url, "bench", again, 1, client=client)["ttft"]["mean_ms"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    report["online_ttft_ms"] = online["ttft"]["mean_ms"]
    report["client"], report["online_ttft_ms_by_client"] = args.clients[0], by_client
    report["hops_ms"] = {
        name: 1e3 * (after[name][0] - before[name][0]) / max(1.0, after[name][1] - before[name][1]) for name in after
    }
    if "offline" in report:
        o = report["offline"]
        print(
            f"offline TTFT: first delta {o['first_delta_ms']:.2f} ms, one-token generation {o['one_token_ms']:.2f} ms"
        )
        for name, ms in o["first_delta_phases_ms"].items():
            print(f"  offline {name:22} {ms:8.3f} ms")
    print(f"online TTFT (client, streamed, concurrency 1): {report['online_ttft_ms']:.2f} ms ({args.clients[0]})")
    for client, ms in list(by_client.items())[1:]:
        print(f"  the same prompts' lengths through {client}: {ms:.2f} ms")
    for name, ms in report["hops_ms"].items():
        print(f"  {name:26} {ms:8.3f} ms")
    print(f"  {'sum of the hops to TTFT':26} {sum(report['hops_ms'][h] for h in HOPS[:-1]):8.3f} ms")
    if args.profile_replica:
        report["profile"] = compare_profiles(
            offline_profile,
            len(requests) * 2 + 8 if not args.no_offline else 0,
            Path(os.environ[PROFILE_ENV] + "-replica0.pstats"),
            len(requests) + 16,
            args.top,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
