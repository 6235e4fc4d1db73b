"""Online serving benchmark in the shape of SGLang's bench_serving: request and token throughput,
TTFT / TPOT / ITL / end-to-end latency (mean, median, p99), against a running server or one it starts,
with the offline engine's throughput on the same workload beside it.

    python bench/online_serving.py --url http://127.0.0.1:8000 --model-name NAME [...]
    python bench/online_serving.py --model PATH [--tp-size K --replicas N --routers R] [--offline] [...]

With --client-procs P the client runs in P processes (each a share of the requests and of the
concurrency), so that its own work (HTTP, SSE parsing, JSON) does not bound what it measures. The client
is aiohttp, as in SGLang's bench_serving (`--client httpx`: the `openai` package's transport, which
adds about 0.5 ms to a streamed request's TTFT on a 2-core host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.6,
        "ignore_eos": True,
        "stream": True,
        "seed": len(prompt),
    }


def _stamped(line: str, stamps: list[float]) -> None:
    """Stamps an SSE line that carries a token's text or the finish (a chunk a client shows)."""
    if line.startswith("data: {"):
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"] or chunk["choices"][0].get("finish_reason"):
            stamps.append(time.perf_counter())


def _timed(start: float, stamps: list[float], max_tokens: int) -> dict:
    end = time.perf_counter()
    return {
        "ttft": stamps[0] - start,
        "e2e": end - start,
        "tokens": max_tokens,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tpot": (end - stamps[0]) / (max_tokens - 1) if max_tokens > 1 else 0.0,
    }


async def one(http, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion through `http`: an aiohttp session (as SGLang's and vLLM's serving
    benchmarks send) or an httpx client (the `openai` package's transport)."""
    start, stamps = time.perf_counter(), []
    if isinstance(http, httpx.AsyncClient):
        async with http.stream("POST", url + "/v1/completions", json=_body(model, prompt, max_tokens)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                _stamped(line, stamps)
    else:
        async with http.post(url + "/v1/completions", json=_body(model, prompt, max_tokens)) as r:
            r.raise_for_status()
            async for raw in r.content:
                _stamped(raw.decode(), stamps)
    return _timed(start, stamps, max_tokens)


@contextlib.asynccontextmanager
async def http_client(kind: str, concurrency: int):
    """The benchmark's HTTP client: `aiohttp` (the default where installed) or `httpx`."""
    if kind == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency + 8)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            yield session
    else:
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 8)) as http:
            yield http


def default_client() -> str:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


async def run_share(
    url: str, model: str, requests: list, concurrency: int, client: str, ready=None
) -> tuple[list, float, float]:
    """One client process's requests at its concurrency through `client` (http_client): the results, and
    when (time.monotonic, the same clock in every process) it started and ended. `ready`: a barrier to
    pass first."""
    async with http_client(client, concurrency) as http:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(req):
            async with sem:
                return await one(http, url, model, *req)

        # a connection open before the clock starts, as a client that keeps its connections has: the
        # first request's TTFT would otherwise count the TCP handshake and the client's first-use setup
        await one(http, url, model, requests[0][0][:16], 1)
        if ready is not None:
            await asyncio.get_running_loop().run_in_executor(None, ready.wait)
        start = time.monotonic()
        results = await asyncio.gather(*(guarded(r) for r in requests))
        return results, start, time.monotonic()


def _client_process(url, model, requests, concurrency, ready, answers, client) -> None:
    answers.put(asyncio.run(run_share(url, model, requests, concurrency, client, ready)))


def run(url: str, model: str, requests: list, concurrency: int, procs: int = 1, client: str | None = None) -> dict:
    """`client`: the HTTP client (http_client; None: default_client())."""
    client = client or default_client()
    procs = max(1, min(procs, concurrency, len(requests)))
    if procs == 1:
        results, start, end = asyncio.run(run_share(url, model, requests, concurrency, client))
        return summarize(results, end - start, sum(len(p) for p, _ in requests))
    ctx = multiprocessing.get_context("spawn")
    ready, answers = ctx.Barrier(procs), ctx.Queue()
    shares = [requests[i::procs] for i in range(procs)]
    limits = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    workers = [
        ctx.Process(target=_client_process, args=(url, model, share, limit, ready, answers, client))
        for share, limit in zip(shares, limits)
    ]
    for w in workers:
        w.start()
    parts = [answers.get() for _ in workers]
    for w in workers:
        w.join()
    results = [r for part, _, _ in parts for r in part]
    wall = max(end for _, _, end in parts) - min(start for _, start, _ in parts)
    return summarize(results, wall, sum(len(p) for p, _ in requests))


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "mean_ms": statistics.fmean(xs) * 1e3,
        "median_ms": statistics.median(xs) * 1e3,
        "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3,
    }


def summarize(results: list[dict], wall: float, prompt_tokens: int) -> dict:
    out_tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "duration_s": wall,
        "request_throughput": len(results) / wall,
        "input_token_throughput": prompt_tokens / wall,
        "output_token_throughput": out_tokens / wall,
        "ttft": _stats([r["ttft"] for r in results]),
        "tpot": _stats([r["tpot"] for r in results]),
        "itl": _stats([x for r in results for x in r["itl"]] or [0.0]),
        "e2e": _stats([r["e2e"] for r in results]),
        "ttfts_ms": [round(r["ttft"] * 1e3, 3) for r in results] if len(results) <= 64 else None,
    }


def offline_engine(args, requests, ttft_prompts: int) -> tuple[float, dict]:
    """The offline engine's output throughput on the requests, and its time to the first token of the
    first ttft_prompts prompts one at a time (each a whole generation of one token: prefill, sampling,
    and the token back on the host), to set beside the online TTFT at concurrency 1."""
    from cluster import LLM, SamplingParams

    with LLM(args.model, tp_size=args.tp_size, **engine_options(args)) as llm:
        params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True, seed=len(p)) for p, m in requests]
        llm.generate([p for p, _ in requests[:4]], params[:4])  # warm-up
        start = time.perf_counter()
        llm.generate([p for p, _ in requests], params)
        throughput = sum(m for _, m in requests) / (time.perf_counter() - start)
        ttfts = []
        for prompt, _ in requests[:ttft_prompts]:
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=len(prompt)))
            ttfts.append(time.perf_counter() - start)
        return throughput, {**_stats(ttfts), "ttfts_ms": [round(t * 1e3, 3) for t in ttfts]}


def release_gpu_memory() -> None:
    """The offline engine's GPU memory back to the driver, before the server's replica (another process)
    sizes its KV cache from what the GPU has free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_options(args) -> dict:
    opts = {"page_size": args.page_size}  # every other setting at the engine's default, online and offline
    if args.load_format:
        opts["load_format"] = args.load_format
    if getattr(args, "extend_graph_tokens", None) is not None:
        opts["extend_graph_tokens"] = args.extend_graph_tokens
    return opts


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`launch.py` in its own process (the router there, the replicas on the Ray it starts), so the
    client's work here never competes with the router's for one interpreter."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parent.parent / "launch.py"),
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(args.tp_size),
        "--replicas",
        str(args.replicas),
        "--page-size",
        str(args.page_size),
        "--served-model-name",
        "bench",
        "--load-format",
        args.load_format or "auto",
        "--log-level",
        "WARNING",
        "--no-dashboard",
        *(
            ["--extend-graph-tokens", str(args.extend_graph_tokens)]
            if getattr(args, "extend_graph_tokens", None) is not None
            else []
        ),
        *(["--routers", str(args.routers)] if args.routers is not None else []),
    ]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"launch.py exited with code {server.returncode} before it served")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("launch.py did not become healthy within 600 s")


def router_processes(server: subprocess.Popen | None) -> list:
    """The processes that serve HTTP: launch.py's (the router with `routers` 0, the driver otherwise)
    and every router actor's on this host (Ray names their processes ray::RouterActor...)."""
    import psutil

    procs = [psutil.Process(server.pid)] if server is not None else []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::RouterActor"):
            procs.append(p)
    return procs


def cpu_seconds(procs: list) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # gone since it was listed
            pass
    return total


def print_report(name: str, rep: dict) -> None:
    print(f"== {name} ==")
    print(
        f"requests {rep['requests']}  duration {rep['duration_s']:.2f} s  "
        f"request throughput {rep['request_throughput']:.2f} req/s  "
        f"output throughput {rep['output_token_throughput']:.1f} tok/s"
    )
    if "router_cpu_s" in rep:
        print(
            f"  router CPU {rep['router_cpu_s']:.2f} s ({rep['router_cpu_us_per_token']:.1f} us per output token) "
            f"in {rep['router_processes']} process(es)"
        )
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = rep[key]
        print(
            f"  {key.upper():5} mean {s['mean_ms']:9.2f} ms  median {s['median_ms']:9.2f} ms  p99 {s['p99_ms']:9.2f} ms"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--model-name")
    p.add_argument("--model", help="start a server on this model (launch.py, in its own process)")
    p.add_argument("--arch", help="instead of --model: a bench architecture (random weights, bf16)")
    p.add_argument("--c1-prompts", type=int, default=None, help="requests for the concurrency-1 run")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--routers",
        type=int,
        default=None,
        help="router actors (launch.py --routers; 0: the launching process; unset: the server's default)",
    )
    p.add_argument("--client-procs", type=int, default=1, help="client processes sharing the requests and concurrency")
    p.add_argument(
        "--client",
        choices=["aiohttp", "httpx"],
        default=default_client(),
        help="the HTTP client: aiohttp as SGLang's bench_serving (default where installed), or httpx",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--load-format", default=None)
    p.add_argument(
        "--extend-graph-tokens", type=int, default=None, help="the engines' extend graphs (0: none; default: theirs)"
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 128])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--offline", action="store_true", help="also run the offline engine on the same workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    report: dict = {"args": vars(args)}
    server = None
    if args.arch:
        from common import model_folder

        args.model, args.load_format = model_folder(args.arch, with_tokenizer=True), "dummy"
    if args.model:
        from transformers import AutoConfig

        vocab = args.vocab or AutoConfig.from_pretrained(args.model).vocab_size
        requests = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
        if args.offline:
            report["offline_output_tok_s"], report["offline_ttft"] = offline_engine(
                args, requests, args.c1_prompts or 8
            )
            release_gpu_memory()
            t = report["offline_ttft"]
            print(
                f"== offline engine ==\noutput throughput {report['offline_output_tok_s']:.1f} tok/s\n"
                f"  TTFT  mean {t['mean_ms']:9.2f} ms  median {t['median_ms']:9.2f} ms  p99 {t['p99_ms']:9.2f} ms "
                "(one prompt at a time)"
            )
        server, url = start_server(args)
        name = "bench"
    else:
        url, name = args.url, args.model_name
        requests = workload(
            args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.vocab or 32000, args.seed
        )
    try:
        # warm-up: prompts of many lengths, so that the concurrency-1 TTFT, like the offline engine's
        # (taken after its whole run), does not pay for first-time allocations of new shapes
        run(url, name, requests[:64], 64, args.client_procs, args.client)
        procs = router_processes(server)
        for c in args.concurrency:
            before = cpu_seconds(procs)
            rep = run(
                url,
                name,
                requests[: args.c1_prompts] if c == 1 and args.c1_prompts else requests,
                c,
                args.client_procs,
                args.client,
            )
            if procs:
                used = cpu_seconds(procs) - before
                rep.update(
                    router_cpu_s=used,
                    router_processes=len(procs),
                    router_cpu_us_per_token=1e6 * used / (rep["output_token_throughput"] * rep["duration_s"]),
                )
            report[f"concurrency_{c}"] = rep
            print_report(f"online, concurrency {c}", rep)
            if "offline_output_tok_s" in report:
                print(
                    f"  online / offline output throughput: {rep['output_token_throughput'] / report['offline_output_tok_s']:.3f}"
                )
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
