"""What grammars cost, in the overlap loop: the offline workload of bench/offline_throughput.py (256
requests, prompts and outputs of 100..1024 tokens) with none of its requests constrained, then with a
share of them (--share, default 10%) under a regular expression, side by side in one process.

    python bench/grammar_cost.py [--share 0.1] [--out r.json] [--arch tiny]
The benchmark models have a word-level tokenizer with one token per id ("t0", "t1", ...), so the
grammar is over those words: `(t[0-9]+)+`, which every sampled token may extend (a constrained request
runs as long as the others). A constrained request sits out the step after each of its own (its mask
needs its last token): the report gives the unconstrained requests' throughput against the run with
none constrained, and both kinds' median time per output token."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from common import StepTimer, add_common_args, config_of, model_folder, report
from offline_throughput import workload

from cluster import LLM, GrammarSpec, SamplingParams

GRAMMAR = GrammarSpec("regex", "(t[0-9]+)+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share", type=float, default=0.1)
    args = parser.parse_args()
    llm = LLM(
        model_folder(args.arch, with_tokenizer=True),
        dtype="bfloat16",
        load_format="dummy",
        page_size=args.page_size,
        max_extend_tokens=16384,
        max_running_reqs=args.max_running_reqs,
        overlap=not args.no_overlap,
        cuda_graph_max_bs=0 if args.no_cuda_graph else 256,
    )
    vocab = llm.engine.hf_config.vocab_size
    prompts, plain = workload(args.num_requests, args.seed, vocab)
    warm_prompts, _ = workload(16, args.seed + 1, vocab)
    warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, seed=0)
    llm.generate(warm_prompts, [warm, dataclasses.replace(warm, grammar=GRAMMAR)] * 8)
    timings: dict[int, tuple[float, float, int]] = {}
    llm.scheduler.on_finish = lambda req, reason: timings.__setitem__(
        req.uid, (req.first_token or 0.0, req.last_token or 0.0, len(req.output_ids))
    )
    runs = []
    every = round(1 / args.share)
    for share in (0.0, args.share):
        params = [
            dataclasses.replace(p, grammar=GRAMMAR) if share and i % every == 0 else p for i, p in enumerate(plain)
        ]
        timings.clear()
        llm.engine.step_timer = timer = StepTimer()
        first_uid = next(llm._uids)  # the uids this run's requests get follow it, in order
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        llm.engine.step_timer = None
        free = [i for i, p in enumerate(params) if p.grammar is None]
        tpot: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for i, p in enumerate(params):
            t0, t1, n = timings[first_uid + 1 + i]
            if n > 1:
                tpot["unconstrained" if p.grammar is None else "constrained"].append((t1 - t0) / (n - 1))
        runs.append(
            {
                "share": share,
                "constrained_requests": len(params) - len(free),
                "seconds": elapsed,
                "output_tok_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
                # over the time until the last unconstrained request is done: the constrained ones,
                # at half the rate, finish later
                "unconstrained_tok_per_s": sum(len(outs[i].token_ids) for i in free)
                / (max(timings[first_uid + 1 + i][1] for i in free) - start),
                **{f"tpot_ms_median_{k}": statistics.median(v) * 1e3 for k, v in tpot.items() if v},
                **timer.decode_summary(),
            }
        )
    base = runs[0]["unconstrained_tok_per_s"]
    result = {"benchmark": "grammar_cost", **config_of(args), "grammar": dataclasses.asdict(GRAMMAR), "runs": runs}
    table = [
        (
            f"share {r['share']:.0%} ({r['constrained_requests']} constrained)",
            f"unconstrained {r['unconstrained_tok_per_s']:,.0f} tok/s ({r['unconstrained_tok_per_s'] / base:.3f}x); "
            f"TPOT median: unconstrained {r.get('tpot_ms_median_unconstrained', float('nan')):.2f} ms, "
            f"constrained {r.get('tpot_ms_median_constrained', float('nan')):.2f} ms; decode step "
            f"{r.get('decode_step_ms_median', float('nan')):.2f} ms",
        )
        for r in runs
    ]
    report(result, args.out, table)
    llm.shutdown()


if __name__ == "__main__":
    main()
