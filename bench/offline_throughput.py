"""Offline throughput, Qwen3-0.6B's architecture with random weights, bf16, the engine's defaults unless a
flag says otherwise, random token-id prompts (ignore_eos, temperature 0.6, seed 0). Workloads:
  default        256 requests of 100..1024 prompt and 100..1024 output tokens ((a))
  prefill_heavy  128 requests of 3000..6000 prompt and 32..128 output tokens

    python bench/offline_throughput.py [--workload prefill_heavy] [--out r.json] [--no-overlap]
                                       [--no-cuda-graph] [--cache naive] [--kv-cache-dtype fp8_e4m3] [--profile]
Reports output tokens per second, the KV-cache size in tokens (fp8_e4m3 holds twice bf16's), and the
GPU's idle time between consecutive decode steps."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import numpy as np
from common import ProfileWindow, StepTimer, add_common_args, config_of, make_llm, report, resolved_kernels

from cluster import SamplingParams

# (requests, prompt lengths, output lengths), each length uniform in its range, both ends included
WORKLOADS = {"default": (256, (100, 1024), (100, 1024)), "prefill_heavy": (128, (3000, 6000), (32, 128))}


def workload(n: int, seed: int, vocab: int, name: str = "default") -> tuple[list[list[int]], list[SamplingParams]]:
    _, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(p_lo, p_hi, size=n, endpoint=True)
    output_lens = rng.integers(o_lo, o_hi, size=n, endpoint=True)
    prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in prompt_lens]
    params = [
        SamplingParams(temperature=0.6, max_tokens=int(k), ignore_eos=True, seed=seed + i)
        for i, k in enumerate(output_lens)
    ]
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    parser.add_argument("--num-requests", type=int, help="default: the workload's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also profile kernels over a window of decode steps")
    parser.add_argument(
        "--profile-from",
        type=int,
        nargs="+",
        default=[50],
        help="with --profile: the decode steps each window of 50 starts at (50: the batch still full; (a)'s batch "
        "shrinks as its requests finish, to about half by step 600)",
    )
    parser.add_argument(
        "--profile-extend", action="store_true", help="also profile kernels over a window of extend steps"
    )
    args = parser.parse_args()
    llm = make_llm(args)
    vocab = llm.engine.hf_config.vocab_size
    prompts, params = workload(args.num_requests or WORKLOADS[args.workload][0], args.seed, vocab, args.workload)
    # warm-up: kernel JIT, cuBLAS heuristics, the caching allocator's pools
    warm_prompts, _ = workload(32, args.seed + 1, vocab)
    llm.generate(warm_prompts, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, seed=0))

    llm.engine.step_timer = timer = StepTimer()
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.engine.step_timer = None
    after = llm.stats()
    output_tokens = sum(len(o.token_ids) for o in outs)
    input_tokens = sum(len(p) for p in prompts)
    result = {
        "benchmark": "offline_throughput",
        "workload": args.workload,
        **config_of(args),
        **resolved_kernels(llm),
        "requests": len(prompts),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": elapsed,
        "kv_cache_tokens": llm.engine.num_pages * llm.engine.page_size,
        "startup": llm.engine.startup.as_dict(),
        "gemm_tuning": [asdict(r) for r in llm.engine.gemm_tuning],
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (input_tokens + output_tokens) / elapsed,
        "spec_decode_num_draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        "spec_decode_num_accepted_tokens": after.spec_decode_num_accepted_tokens
        - before.spec_decode_num_accepted_tokens,
        **timer.decode_summary(),
        **timer.phase_summary(),
    }
    for first in args.profile_from if args.profile else ():  # the same run again, profiling 50 decode steps
        llm.engine.step_timer = window = ProfileWindow(first=first, count=50)
        llm.generate(prompts, params)
        llm.engine.step_timer = None
        result["profile" if first == args.profile_from[0] else f"profile_from_{first}"] = window.top_kernels()
    if args.profile_extend:  # another draw of the workload (the prefix cache holds this one's prompts),
        # profiling 20 extend steps after the first 5
        llm.engine.step_timer = window = ProfileWindow(first=5, count=20, extend=True)
        llm.generate(*workload(len(prompts), args.seed + 2, vocab, args.workload))
        llm.engine.step_timer = None
        result["profile_extend"] = window.top_kernels(40)
    table = [
        ("arch", args.arch),
        ("workload", args.workload),
        ("overlap", not args.no_overlap),
        ("cuda graphs", not args.no_cuda_graph),
        ("cache", args.cache),
        ("kv cache", f"{args.kv_cache_dtype}, {result['kv_cache_tokens']:,} tokens"),
        ("engine start", str(llm.engine.startup)),
        (
            "linear products on a tuned algorithm",
            f"{sum(r['chosen'] for r in result['gemm_tuning'])} of {len(result['gemm_tuning'])}",
        ),
        ("seconds", elapsed),
        ("output tok/s", result["output_tok_per_s"]),
        (
            "speculation: proposed / accepted",
            f"{result['spec_decode_num_draft_tokens']:,} / {result['spec_decode_num_accepted_tokens']:,}",
        ),  # fmt: skip
        ("decode step ms (median)", result.get("decode_step_ms_median", float("nan"))),
        ("idle between decode steps % (median)", result.get("idle_pct_of_step_median", float("nan"))),
        ("idle between decode steps % (total)", result.get("idle_pct_of_step_total", float("nan"))),
        ("extend steps, GPU ms in all", result.get("extend_gpu_ms_total", float("nan"))),
        ("decode steps, GPU ms in all", result.get("decode_gpu_ms_total", float("nan"))),
    ]
    report(result, args.out, table)
    for key in [k for k in result if k.startswith("profile")]:
        print(f"{key}:")
        for row in result[key]:
            print(f"  {row['pct']:5.1f}%  {row['ms']:8.2f} ms  {row['calls']:6d}  {row['kernel']}")
    llm.shutdown()


if __name__ == "__main__":
    main()
