"""The n-gram proposer (prompt lookup): the tokens that followed the latest earlier occurrence of a
request's last n tokens (n from the longest down to 1), over its prompt and output alike. It runs on
rank 0's CPU and needs no model: text that copies from its prompt (edits, summaries, code) repeats."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to k tokens: those after an earlier match of the longest suffix of `tokens` (of n_max ..
    n_min tokens) that occurs before (the latest with k tokens after it, else the earliest); [] when
    no suffix recurs. A match ends before the last token."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    longest = min(n_max, size - 1)
    if longest < n_min:
        return []
    # where a match can end: an earlier place of the last token. A match of n tokens is one of n - 1
    # that the token before it extends, so the matches of each length are found from the last one's,
    # in one pass over the sequence and then over its few candidates (the step's host time at batch 1)
    ends = np.flatnonzero(arr[: size - 1] == arr[size - 1])
    found = []  # the ends of the matches of n = 1, 2, ... tokens
    for n in range(1, longest + 1):
        if n > 1:
            back = ends - (n - 1)
            ends = ends[back >= 0]
            ends = ends[arr[ends - (n - 1)] == arr[size - n]]
        if not len(ends):
            break
        found.append(ends)
    for n in range(min(len(found), longest), n_min - 1, -1):
        starts = found[n - 1] - (n - 1)  # ascending
        # the latest match with k tokens after it, else the earliest (the longest continuation)
        full = starts[starts + n + k <= size]
        start = int(full[-1] if len(full) else starts[0]) + n
        return arr[start : start + k].tolist()
    return []
