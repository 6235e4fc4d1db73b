"""The redraw of a graph-replayed decode step, over the rows that need it only.

A decode graph's head samples every row plainly. Rows that filter (top-k, top-p), use min-p, the
logits processors or a grammar are then drawn again over their processed logits. A bucket's captured
variant does that over all of its rows: its dense work (a float copy of the logits, the penalties'
gathers, the bitmask, softmaxes, a sort when filtering) costs the same for 26 such rows of 256 as for
256 (about 1.7 ms at batch 256 on an H200 for the processors alone). When few of a large batch's rows
need it, the engine instead gathers those rows' logits and runs the step sampler on them eagerly: the
GPU work then follows the rows that need it, for a few dozen launches on the host, which a batch that
large leaves time for. The draw is the same either way (a function of the row's logits, seed and
position), and the rows that are not redrawn keep the head's tokens, which the head wrote into the
token pool already."""

from __future__ import annotations

import numpy as np
import torch

from worker.step_sampler import SampleArgs, StepSampler

# the redraw runs over the rows that need it when the batch has at least this many rows and at most
# this share of them need it; otherwise the bucket's variant graph (no launches on the host)
COMPACT_MIN_BATCH = 32
COMPACT_MAX_SHARE = 0.5
_FIELDS = {"top_p": np.float32, "top_k": np.int32, "min_p": np.float32, "state_row": np.int64,
           "presence": np.float32, "frequency": np.float32, "repetition": np.float32, "ban_stop": bool}


def rows_to_redraw(n: int, rows: dict[str, np.ndarray], scratch_row: int,
                   grammar_rows: np.ndarray | None) -> np.ndarray | None:
    """The sorted rows (of n) that a step must redraw, or None when the bucket's variant should run
    instead. `rows`: the step's per-row filter and processor arrays (those it has)."""
    if n < COMPACT_MIN_BATCH:
        return None
    need = np.zeros(n, dtype=bool)
    if "top_k" in rows:
        need |= (rows["top_k"] > 0) | (rows["top_p"] < 1)
    if "min_p" in rows:
        need |= rows["min_p"] > 0
    if "state_row" in rows:
        need |= rows["state_row"] != scratch_row
    if grammar_rows is not None:
        need[grammar_rows] = True
    picked = np.flatnonzero(need)
    return picked if len(picked) <= COMPACT_MAX_SHARE * n else None


def compact_arrays(picked: np.ndarray, rows: dict[str, np.ndarray], temperature: np.ndarray, seeds: np.ndarray,
                   positions: np.ndarray, token_write: np.ndarray,
                   grammar_rows: np.ndarray | None) -> dict[str, np.ndarray]:
    """The redrawn rows' sampling arguments, to stage (names prefixed `rd_`): which rows, their
    temperature, seed, sampled position and token-pool cell, the filter and processor fields the step
    has, and where its constrained rows fall among them."""
    a = {"rd_rows": picked.astype(np.int64), "rd_temperature": temperature[picked].astype(np.float32),
         "rd_seeds": seeds[picked].astype(np.int64), "rd_positions": positions[picked].astype(np.int64),
         "rd_token_write": token_write[picked].astype(np.int64)}
    for name, dtype in _FIELDS.items():
        if name in rows:
            a[f"rd_{name}"] = rows[name][picked].astype(dtype)
    if grammar_rows is not None:
        a["rd_grammar_at"] = np.searchsorted(picked, grammar_rows).astype(np.int64)
    return a


def redraw(sampler: StepSampler, logits: torch.Tensor, next_tokens: torch.Tensor, d: dict[str, torch.Tensor],
           grammar_mask: torch.Tensor | None, *, procs: bool, filtered: bool) -> torch.Tensor:
    """On the compute stream, after the head: draws the rows of `d["rd_rows"]` again over their
    processed and filtered logits, writes their tokens into the token pool (and their counts into the
    processor state) and over theirs in `next_tokens`, which it returns."""
    rows = d["rd_rows"]
    allowed = None
    if grammar_mask is not None:
        allowed = torch.full((rows.shape[0], grammar_mask.shape[1]), -1, dtype=torch.int32, device=logits.device)
        allowed.index_copy_(0, d["rd_grammar_at"], grammar_mask)
    args = SampleArgs(d["rd_temperature"], d["rd_seeds"], d["rd_positions"], d["rd_token_write"], d.get("rd_top_p"),
                      d.get("rd_top_k"), d.get("rd_min_p"), d.get("rd_state_row"), d.get("rd_presence"),
                      d.get("rd_frequency"), d.get("rd_repetition"), d.get("rd_ban_stop"), allowed)
    tokens = sampler(logits.index_select(0, rows), args, procs=procs, filtered=filtered)
    return next_tokens.index_copy_(0, rows, tokens)
