"""Speculative decoding: batch-1 milliseconds per output token and decode throughput at larger
batches, without speculation, with n-gram proposals (pipelined, the default, and ngram-wait: each
request waiting for its last verify step's result) and with a draft model identical to the target
(random weights, greedy: every proposal is accepted, the ceiling of the machinery), and with a random
EAGLE-3 head (eagle3-always: its proposals are rarely kept, so it shows what its steps cost), on Qwen3-0.6B's
architecture by default. Every method runs at the defaults, where speculation keeps itself on only
while it measures faster (speculative_adaptive), and a draft as large as the model never runs; a method
named with -always (draft-always, ngram-always, ngram-wait-always) speculates whenever it may, what the
machinery gives where it does not pay. Prompts of random tokens; outputs of --output-len tokens, ignore_eos.

    python bench/spec_decode.py [--out r.json] [--methods off ngram ngram-wait draft draft-always] [--k 4]
        [--batches 1 64]"""

from __future__ import annotations

import argparse
import gc
import statistics

import numpy as np
from common import add_common_args, config_of, eagle3_head_folder, kernels_of, model_folder, report, token_arrivals

from cluster import LLM, SamplingParams

METHODS = [
    "off",
    "ngram",
    "ngram-wait",
    "draft",
    "ngram-always",
    "ngram-wait-always",
    "draft-always",
    "eagle3-always",
]


def make(args, method: str) -> LLM:
    folder = model_folder(args.arch)
    spec = {}
    always = method.endswith("-always")
    method = method.removesuffix("-always")
    if method != "off":
        spec = dict(speculative_method=method.removesuffix("-wait"), num_speculative_tokens=args.k)
        spec["speculative_pipeline"] = not method.endswith("-wait")
        spec["speculative_adaptive"] = not always
    if method == "draft":
        spec["speculative_model"] = folder  # with dummy weights: the same weights as the target's
    elif method == "eagle3":  # a random head: its proposals are rarely kept, the cost of its machinery
        spec["speculative_model"] = eagle3_head_folder(args.arch)
    # pages for the largest batch's whole sequences (the draft's cache has as many), not the memory budget
    tokens = max(args.batches) * (args.prompt_len + args.output_len + args.k + 1)
    return LLM(
        folder,
        kernels=kernels_of(args),
        dtype="bfloat16",
        load_format="dummy",
        page_size=args.page_size,
        num_pages=-(-tokens // args.page_size) + max(args.batches),
        max_running_reqs=max(args.batches),
        overlap=not args.no_overlap,
        cuda_graph_max_bs=0 if args.no_cuda_graph else 256,
        **spec,
    )


def measure(llm: LLM, batch: int, args, seed: int) -> dict:
    """Per request, the time from its first token to its last over the tokens after the first (its
    decode, prefill excluded); the batch's decode throughput over the span where all of them decode."""
    rng = np.random.default_rng(seed)
    vocab = llm.engine.hf_config.vocab_size
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
    )
    run = token_arrivals(llm, prompts, params)
    times = list(run.arrivals.values())
    start, end = max(t[0] for t in times), max(t[-1] for t in times)
    return {
        "ms_per_token": run.ms_per_token,
        "decode_tok_per_s": sum(sum(1 for x in t if x > start) for t in times) / (end - start),
        "acceptance": run.acceptance,
        "draft_tokens": run.drafted,
        "accepted_tokens": run.accepted,
        # rows launched on a verify step still in flight, and of them those void (it kept fewer than all)
        "pipelined_rows": run.pipelined,
        "void_rows": run.void,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--methods", nargs="+", default=["off", "ngram", "draft"], choices=METHODS)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's (1: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="every request's (0: off)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    table = []
    for method in args.methods:
        llm = make(args, method)
        try:
            for batch in args.batches:
                measure(llm, batch, args, seed=100)  # warm-up: kernels, graphs and positions first visited
                runs = [measure(llm, batch, args, seed=i) for i in range(args.repeats)]
                key = f"{method}_b{batch}"
                results[key] = {
                    "ms_per_token": statistics.median(r["ms_per_token"] for r in runs),
                    "decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in runs),
                    "acceptance": runs[-1]["acceptance"],
                    "void_share": runs[-1]["void_rows"] / max(runs[-1]["pipelined_rows"], 1),
                    "runs": runs,
                }
                r = results[key]
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
                rows = runs[-1]
                table.append(
                    (
                        key,
                        f"{r['ms_per_token']:.3f} ms/token, {r['decode_tok_per_s']:.0f} tok/s, accept {acc}, "
                        f"pipelined rows {rows['pipelined_rows']} (void {rows['void_rows']})",
                    )
                )
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    off = {b: results.get(f"off_b{b}") for b in args.batches}
    for key, r in results.items():
        base = off.get(int(key.rsplit("_b", 1)[1]))
        if base is not None and not key.startswith("off"):
            r["speedup_per_token"] = base["ms_per_token"] / r["ms_per_token"]
            r["throughput_ratio"] = r["decode_tok_per_s"] / base["decode_tok_per_s"]
            table.append(
                (f"{key} vs off", f"{r['speedup_per_token']:.2f}x per token, {r['throughput_ratio']:.2f}x tok/s")
            )
    result = {
        "benchmark": "spec_decode",
        **config_of(args),
        "k": args.k,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        **{f"{key}_{m}": r[m] for key, r in results.items() for m in ("ms_per_token", "decode_tok_per_s")},
        "results": results,
    }
    report(result, args.out, table)


if __name__ == "__main__":
    main()
