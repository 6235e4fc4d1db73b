"""What the logits processors (penalties, logit_bias, min_tokens, min_p) cost: the offline workload of
bench/offline_throughput.py (256 requests, prompts and outputs of 100..1024 tokens) run with a share of
its requests using them, side by side in one process: 0% (the plain path, no processor graph
replayed), then each --share given.

    python bench/sampling_cost.py [--share 0.1 1.0] [--out r.json] [--arch tiny]
A request "using processors" sets presence 0.5, frequency 0.5, repetition 1.1, min_p 0.05, a bias on
16 token ids and min_tokens 50. Reports output tok/s per share and the decode step's median GPU time."""

from __future__ import annotations

import argparse
import dataclasses
import time

from common import StepTimer, add_common_args, config_of, make_llm, report
from offline_throughput import workload

from cluster import SamplingParams


def with_processors(p: SamplingParams, vocab: int) -> SamplingParams:
    return dataclasses.replace(
        p,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias={(97 * i) % vocab: 1.0 for i in range(16)},
        min_tokens=min(50, p.max_tokens),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share", type=float, nargs="+", default=[0.1, 1.0])
    args = parser.parse_args()
    llm = make_llm(args)
    vocab = llm.engine.hf_config.vocab_size
    prompts, plain = workload(args.num_requests, args.seed, vocab)
    warm_prompts, _ = workload(32, args.seed + 1, vocab)
    warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, seed=0)
    llm.generate(warm_prompts, [warm, with_processors(warm, vocab)] * 16)
    runs = []
    for share in [0.0, *args.share]:
        every = round(1 / share) if share else 0  # requests 0, every, 2 * every, ... use processors
        params = [with_processors(p, vocab) if every and i % every == 0 else p for i, p in enumerate(plain)]
        llm.engine.step_timer = timer = StepTimer()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        llm.engine.step_timer = None
        tokens = sum(len(o.token_ids) for o in outs)
        runs.append(
            {
                "share": share,
                "requests_with_processors": sum(p is not q for p, q in zip(params, plain)),
                "output_tokens": tokens,
                "seconds": elapsed,
                "output_tok_per_s": tokens / elapsed,
                **timer.decode_summary(),
            }
        )
    base = runs[0]["output_tok_per_s"]
    result = {"benchmark": "sampling_cost", **config_of(args), "runs": runs}
    table = [
        (
            f"share {r['share']:.0%} ({r['requests_with_processors']} requests)",
            f"{r['output_tok_per_s']:,.0f} tok/s ({r['output_tok_per_s'] / base:.3f}x), decode step "
            f"{r.get('decode_step_ms_median', float('nan')):.2f} ms",
        )
        for r in runs
    ]
    report(result, args.out, table)
    llm.shutdown()


if __name__ == "__main__":
    main()
