"""The redraw of a graph-replayed decode step, over the rows that need it only.

A decode graph's head samples every row plainly. Rows that filter (top-k, top-p), use min-p, the
logits processors or a grammar are then drawn again over their processed logits. A bucket's captured
variant does that over all of its rows: its dense work (a float copy of the logits, the penalties'
gathers, the bitmask, softmaxes, a sort when filtering) costs the same for 26 such rows of 256 as for
256. When few of a large batch's rows
need it, the engine instead gathers those rows' logits and runs the step sampler on them eagerly: the
GPU work then follows the rows that need it, for a few dozen launches on the host, which a batch that
large leaves time for. The draw is the same either way (a function of the row's logits, seed and
position), and the rows that are not redrawn keep the head's tokens, which the head wrote into the
token pool already."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from worker.sampling.columns import COLUMNS, DRAW, VARIANT_GROUPS, columns_of, rows_using
from worker.sampling.step_sampler import SampleArgs, StepSampler, allowed_tokens

A = TypeVar("A")  # np.ndarray on the host, torch.Tensor once staged

# the redraw runs over the rows that need it when the batch has at least this many rows and at most
# this share of them need it; otherwise the bucket's variant graph (no launches on the host)
COMPACT_MIN_BATCH = 32
COMPACT_MAX_SHARE = 0.5


@dataclass
class RedrawInputs(Generic[A]):
    """The redrawn rows' sampling arguments ([R] each, R rows of the batch)."""

    rows: A  # int64: which rows of the batch, sorted
    positions: A  # int64: the position each samples
    token_write: A  # int64: its token-pool cell
    columns: dict[str, A]  # the draw's columns and those of the variant groups the step has, by name
    grammar_at: A | None = None  # int64 [G]: where the step's constrained rows fall among them


def rows_to_redraw(
    n: int, variant: Mapping[str, np.ndarray], scratch_row: int, grammar_rows: np.ndarray | None
) -> np.ndarray | None:
    """The sorted rows (of n) that a step must redraw, or None when the bucket's variant should run
    instead. `variant`: the step's columns of the variant groups it has."""
    if n < COMPACT_MIN_BATCH:
        return None
    need = np.zeros(n, dtype=bool)
    for group in VARIANT_GROUPS:
        if all(c.name in variant for c in columns_of(group)):
            need |= rows_using(group, variant, scratch_row)
    if grammar_rows is not None:
        need[grammar_rows] = True
    picked = np.flatnonzero(need)
    return picked if len(picked) <= COMPACT_MAX_SHARE * n else None


def redraw_inputs(
    picked: np.ndarray,
    columns: Mapping[str, np.ndarray],
    positions: np.ndarray,
    token_write: np.ndarray,
    grammar_rows: np.ndarray | None,
) -> RedrawInputs[np.ndarray]:
    """The redrawn rows' arguments, to stage: `columns` holds the step's draw columns and its variant
    groups' (those it has); each is cast as the step sampler reads it."""
    return RedrawInputs(
        rows=picked.astype(np.int64),
        positions=positions[picked].astype(np.int64),
        token_write=token_write[picked].astype(np.int64),
        columns={
            c.name: columns[c.name][picked].astype(c.staged) for c in COLUMNS if c.group == DRAW or c.name in columns
        },
        grammar_at=np.searchsorted(picked, grammar_rows).astype(np.int64) if grammar_rows is not None else None,
    )


def redraw(
    sampler: StepSampler,
    logits: torch.Tensor,
    next_tokens: torch.Tensor,
    r: RedrawInputs[torch.Tensor],
    grammar_mask: torch.Tensor | None,
    *,
    procs: bool,
    filtered: bool,
) -> torch.Tensor:
    """On the compute stream, after the head: draws the rows of `r` again over their processed and
    filtered logits, writes their tokens into the token pool (and their counts into the processor
    state) and over theirs in `next_tokens`, which it returns."""
    allowed = allowed_tokens(r.rows.shape[0], r.grammar_at, grammar_mask) if grammar_mask is not None else None
    args = SampleArgs.of(r.columns, r.positions, r.token_write, allowed)
    tokens = sampler(logits.index_select(0, r.rows), args, procs=procs, filtered=filtered)
    return next_tokens.index_copy_(0, r.rows, tokens)
