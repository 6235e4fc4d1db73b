"""mini-sglang on the prefill-heavy workload (bench/offline_throughput.py --workload prefill_heavy): 128
prompts of 3,000-6,000 tokens, 32-128 output tokens each, the same token lists, through the peer's own
runner (.peer/bench_minisgl.py, ../shared/peer/README.md), whose draws hold only (a)'s shapes. The runner
is used as it is, with this workload's draw added and mini-sglang's longest sequence raised from its
bench.py's 4,096 to 8,192 (the prompts run to 6,128 tokens); everything else as it runs (a).

    bash .peer/run_minisgl.sh setup && PYTHONPATH=/tmp/minisgl_src:/tmp/site \\
        python3 bench/peer_prefill_heavy.py [--runs 2] [--arch qwen3-0.6b] [--out FILE]

(`bench/gpu.sh peer_prefill_heavy` does so.) It imports numpy and the peer's runner only (mini-sglang
refuses to start in a process that has initialised CUDA), so the draw is written out again here;
tests/test_peer_draws.py holds it equal to the project's."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

PEER = Path(__file__).resolve().parents[1] / ".peer"
# bench/offline_throughput.py's WORKLOADS["prefill_heavy"] and its defaults: seed 0, Qwen3's vocabulary
REQUESTS, PROMPT_LENS, OUTPUT_LENS, SEED, VOCAB = 128, (3000, 6000), (32, 128), 0, 151936
MAX_SEQ_LEN = 8192


def prefill_heavy(n: int = REQUESTS, seed: int = SEED, vocab: int = VOCAB) -> tuple[list[list[int]], list[int]]:
    """The prompts and max_tokens that offline_throughput.workload(n, seed, vocab, "prefill_heavy") draws."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(*PROMPT_LENS, size=n, endpoint=True)
    output_lens = rng.integers(*OUTPUT_LENS, size=n, endpoint=True)
    prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in prompt_lens]
    return prompts, [int(k) for k in output_lens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--arch", default="qwen3-0.6b")
    parser.add_argument("--out", help="default $OUT/minisgl_prefill_heavy_<arch>.json")
    args = parser.parse_args()
    if not (PEER / "bench_minisgl.py").exists():
        raise SystemExit(f"no {PEER}/bench_minisgl.py: ../shared/peer/README.md makes .peer/")
    sys.path.insert(0, str(PEER))
    import bench_minisgl
    import draws

    draws.DRAWS["prefill_heavy"] = prefill_heavy
    bench_minisgl.LLM_KWARGS["max_seq_len_override"] = MAX_SEQ_LEN
    out = args.out or str(Path(os.environ.get("OUT", ".")) / f"minisgl_prefill_heavy_{args.arch}.json")
    # the runner's own arguments: this workload's draw, no batch-1 runs
    sys.argv = [
        sys.argv[0],
        "--arch",
        args.arch,
        "--draws",
        f"prefill_heavy:{args.runs}",
        "--b1-repeat",
        "0",
        "--out",
        out,
    ]
    bench_minisgl.main()


if __name__ == "__main__":
    main()
