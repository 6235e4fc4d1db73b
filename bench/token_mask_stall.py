"""What a request's bad words cost the other requests: the scheduler's longest step while a request with many
bad words is admitted beside 64 decoding ones (a scripted executor, tests/scripted.py: no model work), and how
long the words take to become its mask on a compile thread. Before, the loop tokenized them itself, inside
a step: the time `bad_word_sequences` takes alone is printed first.

    python bench/token_mask_stall.py [--model FOLDER_OR_GGUF] [--words 1000 10000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripted import scripted_scheduler  # noqa: E402

from cluster.model_info import load_tokenizer  # noqa: E402
from cluster.scheduler.grammars import Grammars  # noqa: E402
from cluster.scheduler.token_set import bad_word_sequences  # noqa: E402


def words_of(tokenizer, n: int, seed: int = 0) -> list[str]:
    """n words of the vocabulary's (its tokens decoded), distinct and not blank."""
    rng = random.Random(seed)
    vocab = [w for w in (tokenizer.decode([t]).strip() for t in range(len(tokenizer))) if w.isalpha()]
    return rng.sample(sorted(set(vocab)), n)


def measure(tokenizer, words: list[str], running: int = 64) -> tuple[float, float, float]:
    """The median step (ms) before the masked request arrives, the longest from its arrival until it has its
    mask, and that wait (ms)."""
    run = scripted_scheduler(
        num_pages=4096, page_size=16, max_running_reqs=running + 1, max_seq_len=4096, keep_deltas=False
    )
    sched = run.scheduler
    sched.grammars = sched.builder.grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        for uid in range(running):
            run.submit(uid, list(range(1, 129)), max_tokens=1024, ignore_eos=True)
        for _ in range(20):  # every one admitted and decoding (one may be in the step in flight)
            sched.step()
        steps = []
        for _ in range(50):
            start = time.perf_counter()
            sched.step()
            steps.append(time.perf_counter() - start)
        arrived = time.perf_counter()
        run.submit(running, list(range(1, 129)), max_tokens=8, bad_words=words)
        longest = 0.0
        while (req := sched.reqs.get(running)) is None or req.matcher is None:
            if running in run.ended:
                raise RuntimeError(f"the masked request ended: {run.ended[running]}")
            start = time.perf_counter()
            sched.step()
            longest = max(longest, time.perf_counter() - start)
        return statistics.median(steps) * 1e3, longest * 1e3, (time.perf_counter() - arrived) * 1e3
    finally:
        sched.grammars.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or GGUF file (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--words", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args()
    if args.model is None:
        from demo import smollm2_folder

        args.model = str(smollm2_folder())
    tokenizer = load_tokenizer(args.model)
    print(
        f"{'words':>6} {'tokenizing, ms':>15} {'median step, ms':>16} {'longest step, ms':>17} {'mask after, ms':>15}"
    )
    for n in args.words:
        words = words_of(tokenizer, n)
        start = time.perf_counter()
        bad_word_sequences(tokenizer, words)
        inline = (time.perf_counter() - start) * 1e3
        median, longest, ready = measure(tokenizer, words)
        print(f"{n:>6} {inline:>15.1f} {median:>16.2f} {longest:>17.2f} {ready:>15.1f}")


if __name__ == "__main__":
    main()
