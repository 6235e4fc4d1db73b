"""Where the host's time goes where the GPU waits on it: cProfile over one-prompt prefills (a one-token
generation of each prompt, TTFT's path: the eager extend step) and over a batch-1 generation with
speculative decoding (a speculating request waits for its own result, so each step's host work is
on the critical path).

    python bench/host_profile.py [--part prefill|spec] [--arch qwen3-0.6b] [--prompts 20] [--prompt-len 500]
                                 [--spec ngram|draft] [--top 35] [--out r.json]

Prints, per part, the wall time per generation and the functions with the most time of their own
(tottime) and with the most in all (cumtime); the JSON holds the same tables."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
from common import ARCHS, add_common_args, make_llm, model_folder, report

from cluster import LLM, SamplingParams


def _table(prof: cProfile.Profile, key: str, top: int) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_cc, calls, tt, ct, _callers) in st.stats.items():
        rows.append(
            {
                "where": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})",
                "calls": calls,
                "tottime_ms": tt * 1e3,
                "cumtime_ms": ct * 1e3,
            }
        )
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:top]


def _print(title: str, rows: list[dict], per: int) -> None:
    print(f"--- {title} (ms per generation; {per} generations)")
    for r in rows:
        print(
            f"  {r['tottime_ms'] / per:9.3f} own {r['cumtime_ms'] / per:9.3f} all {r['calls'] / per:8.1f} calls  {r['where']}"
        )


def profiled(fn, n: int, top: int, title: str) -> dict:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(n):
        fn(i)
    prof.disable()
    wall_ms = (time.perf_counter() - t0) * 1e3 / n
    own, total = _table(prof, "tottime_ms", top), _table(prof, "cumtime_ms", top)
    print(f"=== {title}: {wall_ms:.3f} ms per generation (under cProfile)")
    _print("own time", own, n)
    _print("cumulative", total, n)
    return {"wall_ms_per_generation": wall_ms, "own": own, "cumulative": total}


def prefill_part(args, prompts: list[list[int]]) -> dict:
    out: dict = {}
    with make_llm(args) as llm:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for q in prompts[-2:]:  # warm-up
            llm.generate([q], one)
        t0 = time.perf_counter()
        for q in prompts[: args.prompts]:
            llm.generate([q[::-1]], one)  # reversed: no prefix-cache hit on the profiled pass below
        out["wall_ms_unprofiled"] = (time.perf_counter() - t0) * 1e3 / args.prompts
        print(f"one-token generation of {args.prompt_len}-token prompts: {out['wall_ms_unprofiled']:.3f} ms")
        out.update(profiled(lambda i: llm.generate([prompts[i]], one), args.prompts, args.top, "prefill"))
    return out


def spec_part(args, prompts: list[list[int]]) -> dict:
    out: dict = {}
    spec = dict(speculative_method=args.spec, num_speculative_tokens=4)
    if args.spec == "draft":
        spec["speculative_model"] = model_folder(args.arch)
    opts = dict(dtype="bfloat16", load_format="dummy", page_size=args.page_size, speculative_max_pause=0)
    with LLM(model_folder(args.arch), **opts, **spec) as llm:
        gen = SamplingParams(temperature=0.0, max_tokens=args.spec_tokens, ignore_eos=True)
        llm.generate([prompts[0][:32]], gen)  # warm-up
        t0 = time.perf_counter()
        llm.generate([prompts[1][:32]], gen)
        out["wall_ms_unprofiled"] = (time.perf_counter() - t0) * 1e3
        st = llm.stats()
        print(
            f"speculative generation of {args.spec_tokens} tokens: {out['wall_ms_unprofiled']:.1f} ms; "
            f"accepted {st.spec_decode_num_accepted_tokens} of {st.spec_decode_num_draft_tokens}"
        )
        out.update(profiled(lambda i: llm.generate([prompts[2 + i][:32]], gen), 2, args.top, "speculative"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--part", choices=["prefill", "spec"], default="prefill", help="one part a process")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--spec", choices=["ngram", "draft"], default="ngram")
    p.add_argument("--spec-tokens", type=int, default=256, help="output tokens of the speculative generation")
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    vocab = ARCHS[args.arch]["vocab_size"]
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts + 2)]
    part = prefill_part if args.part == "prefill" else spec_part
    result = {"args": vars(args), args.part: part(args, prompts)}
    report(result, args.out, [(f"{args.part} ms a generation (unprofiled)", result[args.part]["wall_ms_unprofiled"])])


if __name__ == "__main__":
    main()
