"""Speculative decoding on a real model and real text that copies from its prompt: SmolLM2-135M-Instruct (the
demo's model, or another folder or GGUF file) asked to return passages of the Python standard library's
documentation with their mistakes corrected, an editing task whose answer repeats the passage, so that
n-gram lookup (prompt lookup) finds what the model goes on to write. Greedy, each answer to its end of turn
or max_tokens.

    python bench/real_spec.py [--model PATH] [--dtype bfloat16] [--batches 1 32] [--methods off ngram ngram-wait]
                              [--out r.json]

For each method and batch: milliseconds per output token (a request's first token to its last over the
tokens after the first, the median over requests), output tokens per second over the batch's wall time,
the acceptance rate, and how many answers differ from those without speculation (none in float32; in
bfloat16 a verify step's rounding may part a near-tie)."""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import report, token_arrivals
from real_text import default_model, documentation

from cluster import LLM, SamplingParams

INSTRUCTION = "Return this documentation with its spelling and grammar mistakes corrected, and nothing else:\n\n"


def edit_prompts(tokenizer, n: int, seed: int, passage_tokens: int) -> list[list[int]]:
    text = tokenizer(documentation()).input_ids
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        start = int(rng.integers(0, len(text) - passage_tokens))
        passage = tokenizer.decode(text[start : start + passage_tokens])
        messages = [{"role": "user", "content": INSTRUCTION + passage}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return prompts


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Generates every prompt at once, greedily: ms per token per request (first token to last), the
    batch's output tokens per second, and the answers."""
    start = time.perf_counter()
    run = token_arrivals(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in run.outputs)
    return {
        "ms_per_token": run.ms_per_token,
        "output_tok_per_s": tokens / elapsed,
        "output_tokens": tokens,
        "acceptance": run.acceptance,
        # rows launched on a verify step still in flight (speculation's pipeline), and of them those void
        "pipelined_rows": run.pipelined,
        "void_rows": run.void,
        "answers": [o.token_ids for o in run.outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder or GGUF file (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--methods", nargs="+", default=["off", "ngram", "ngram-wait"], choices=["off", "ngram", "ngram-wait"]
    )
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--passage-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    model = args.model or default_model()
    result: dict = {"benchmark": "real_spec", "model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype}
    table = []
    answers: dict[int, list] = {}
    for method in args.methods:
        spec = {}
        if method != "off":  # ngram-wait: each request waits for its last verify step's result
            spec = dict(speculative_method="ngram", num_speculative_tokens=args.k)
            spec["speculative_pipeline"] = method != "ngram-wait"
        with LLM(model, dtype=args.dtype, **spec) as llm:
            warm = edit_prompts(llm.tokenizer, 8, 99, args.passage_tokens)
            llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=32))  # kernels, graphs, allocator
            for batch in args.batches:
                prompts = edit_prompts(llm.tokenizer, batch, batch, args.passage_tokens)
                r = measure(llm, prompts, args.max_tokens)
                if method == "off":
                    answers[batch] = r["answers"]
                elif batch in answers:
                    r["answers_differing"] = sum(a != b for a, b in zip(r["answers"], answers[batch]))
                if batch == args.batches[0]:
                    r["first_answer"] = llm.tokenizer.decode(r["answers"][0], skip_special_tokens=True)
                del r["answers"]
                result[f"{method}_b{batch}"] = r
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
                table.append((f"{method} batch {batch}", f"{r['ms_per_token']:.3f} ms/token, "
                              f"{r['output_tok_per_s']:,.0f} tok/s, acceptance {acc}, "
                              f"pipelined rows {r['pipelined_rows']} (void {r['void_rows']})"))  # fmt: skip
    for method in args.methods:
        for batch in args.batches:
            if method != "off" and f"off_b{batch}" in result:
                r, off = result[f"{method}_b{batch}"], result[f"off_b{batch}"]
                r["speed_vs_off"] = off["ms_per_token"] / r["ms_per_token"]
                table.append((f"{method} batch {batch} vs off", f"{r['speed_vs_off']:.2f}x per token, "
                              f"{r.get('answers_differing', '-')} answers differ"))  # fmt: skip
    report(result, args.out, table)
    if "off_b" + str(args.batches[0]) in result:
        print("  answer:", " ".join(result[f"off_b{args.batches[0]}"]["first_answer"].split())[:200])


if __name__ == "__main__":
    main()
