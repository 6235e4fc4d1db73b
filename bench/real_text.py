"""Offline throughput on a real model and real text: workload (a)'s shape (256 requests, prompts of 100..1024
tokens, 100..1024 output tokens, every output to its max_tokens) as chat requests to SmolLM2-135M-Instruct
(the demo's model) or another model folder or GGUF file. The prompts ask to summarize passages of the
Python standard library's own documentation (the docstrings of its modules, on any host), cut to the drawn
length; sampling as the model card recommends (temperature 0.2, top-p 0.9), seeded.

    python bench/real_text.py [--model PATH] [--dtype bfloat16] [--out r.json]
Reports output tokens per second, the engine's start, and the beginning of a few answers."""

from __future__ import annotations

import argparse
import importlib
import inspect
import time

import numpy as np
from common import report

from cluster import LLM, SamplingParams

DOC_MODULES = [
    "argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email", "functools",
    "heapq", "http.client", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "queue", "random",
    "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "threading", "typing",
    "unittest", "urllib.parse", "uuid", "zipfile",
]  # fmt: skip


def documentation() -> str:
    """Real English text: the docstrings of the modules above and of their public classes and functions."""
    parts = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def workload(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    text = tokenizer(documentation()).input_ids
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        want = int(rng.integers(100, 1024, endpoint=True))
        instruction = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Summarize this documentation:\n\n"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        start = int(rng.integers(0, len(text) - 1024))
        passage = tokenizer.decode(text[start : start + max(want - len(instruction), 8)])
        messages = [{"role": "user", "content": f"Summarize this documentation:\n\n{passage}"}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        out = int(rng.integers(100, 1024, endpoint=True))
        params.append(SamplingParams(temperature=0.2, top_p=0.9, max_tokens=out, ignore_eos=True, seed=seed + i))
    return prompts, params


def default_model() -> str:
    from demo import smollm2_folder

    return str(smollm2_folder())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder or GGUF file (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    llm = LLM(args.model or default_model(), dtype=args.dtype)
    prompts, params = workload(llm.tokenizer, args.num_requests, args.seed)
    warm, _ = workload(llm.tokenizer, 32, args.seed + 1)  # kernel JIT, cuBLAS heuristics, the allocator's pools
    llm.generate(warm, SamplingParams(temperature=0.2, max_tokens=16, ignore_eos=True, seed=0))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for o in outs)
    input_tokens = sum(len(p) for p in prompts)
    # the same prompts to their end of turn, for answers to read (not timed)
    answers = llm.generate(prompts[:3], SamplingParams(temperature=0.2, top_p=0.9, max_tokens=48, seed=args.seed))
    result = {
        "benchmark": "real_text",
        "model": args.model or "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "requests": len(prompts),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": elapsed,
        "startup": llm.engine.startup.as_dict(),
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (input_tokens + output_tokens) / elapsed,
        "answers": [llm.tokenizer.decode(a.token_ids, skip_special_tokens=True) for a in answers],
    }
    table = [
        ("model", result["model"]),
        ("dtype", args.dtype),
        ("requests / input / output tokens", f"{len(prompts)} / {input_tokens:,} / {output_tokens:,}"),
        ("engine start", str(llm.engine.startup)),
        ("seconds", elapsed),
        ("output tok/s", result["output_tok_per_s"]),
    ]
    report(result, args.out, table)
    for answer in result["answers"]:
        print("  answer:", " ".join(answer.split())[:160])
    llm.shutdown()


if __name__ == "__main__":
    main()
