"""The n-gram proposer (prompt lookup): the tokens that followed the latest earlier occurrence of a
request's last n tokens (n from the longest down to 1), over its prompt and output alike. It runs on
rank 0's CPU and needs no model: text that copies from its prompt (edits, summaries, code) repeats."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to k tokens: those after an earlier match of the longest suffix of `tokens` (of n_max ..
    n_min tokens) that occurs before (the latest with k tokens after it, else the earliest); [] when
    no suffix recurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows that start early enough to have at least one token after them, the suffix excluded
        windows = sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if len(hits):
            # the latest match with k tokens after it, else the earliest (the longest continuation)
            full = hits[hits + n + k <= size]
            start = int(full[-1] if len(full) else hits[0]) + n
            return arr[start : start + k].tolist()
    return []
