"""A step's sampling inputs, staged from its batch description: which column groups it uses, and the
arrays its kind of step needs (the columns of an eager step, a replayed step's sampler block or its
redrawn rows, the processor state set afresh, the constrained rows, the prompt tokens scored)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import torch

from worker.batch import BatchDesc
from worker.graph_io import SAMPLER_IO, sampler_io_pads
from worker.sampling.columns import COLUMNS, DRAW, FILTER, MIN_P, PROCS, VARIANT_GROUPS, columns_of, rows_using
from worker.sampling.processors import ProcessorInitArrays, ProcessorState
from worker.sampling.resample import RedrawInputs, redraw_inputs, rows_to_redraw
from worker.sampling.step_sampler import SampleArgs, allowed_tokens

A = TypeVar("A")  # np.ndarray on the host, torch.Tensor once staged


@dataclass
class SamplingInputs(Generic[A]):
    """One step's sampling: the column groups some row uses, and its arrays (None: not needed)."""

    groups: frozenset[str]
    # an eager step: each row's token-pool cell, and the columns of the groups it uses, by name
    token_write: A | None = None
    columns: dict[str, A] = field(default_factory=dict)
    # a replayed step: its variant graph's block (worker/graph_io.py SAMPLER_IO), or the rows redrawn alone
    sampler_io: A | None = None
    redraw: RedrawInputs[A] | None = None
    init: ProcessorInitArrays[A] | None = None  # processor state set afresh before the step samples
    grammar_rows: A | None = None  # int64 [G]: the constrained rows ...
    grammar_mask: A | None = None  # int32 [G, W]: ... and their allowed tokens
    plp_idx: A | None = None  # int64 [P]: the prompt tokens scored (prompt logprobs) ...
    plp_target: A | None = None  # int64 [P]: ... and the prompt token that follows each

    @property
    def all_greedy(self) -> bool:
        """Every row has temperature 0: the argmax, no draw."""
        return DRAW not in self.groups

    @property
    def filtered(self) -> bool:
        """Some row uses top-k or top-p: a sort."""
        return FILTER in self.groups

    @property
    def any_min_p(self) -> bool:
        return MIN_P in self.groups

    @property
    def procs(self) -> bool:
        """Some row uses the logits processors or a grammar."""
        return PROCS in self.groups

    def args(self: SamplingInputs[torch.Tensor], positions: torch.Tensor, batch_size: int) -> SampleArgs:
        """An eager step's sampler arguments (`positions`: the position each row samples)."""
        allowed = None
        if self.grammar_rows is not None:
            allowed = allowed_tokens(batch_size, self.grammar_rows, self.grammar_mask)
        return SampleArgs.of(self.columns, positions, self.token_write, allowed)


def step_groups(columns: dict[str, np.ndarray], has_procs: bool, scratch_row: int) -> frozenset[str]:
    """The groups some row of a step uses (`columns`: those its description holds). Filters and min-p
    count only when some row draws; the processors whenever the description has them."""
    used = {PROCS} if has_procs else set()
    if rows_using(DRAW, columns, scratch_row).any():
        used.add(DRAW)
        used.update(
            g for g in (FILTER, MIN_P) if columns_of(g)[0].name in columns and rows_using(g, columns, scratch_row).any()
        )
    return frozenset(used)


def stage_sampling(
    desc: BatchDesc,
    columns: dict[str, np.ndarray],
    graph_bs: int,
    positions: np.ndarray,
    token_write: np.ndarray,
    state: ProcessorState,
) -> SamplingInputs[np.ndarray]:
    """The host arrays of `desc`'s sampling, to upload (`columns`: desc_columns(desc)). `graph_bs` > 0:
    a decode step replayed from the graph of that batch size (whose draw columns travel in its per-step
    block); `positions` and `token_write`: the position each row samples and its token-pool cell."""
    s = SamplingInputs(step_groups(columns, desc.procs is not None, state.scratch_row))
    if desc.proc_init:
        s.init = state.init_arrays(desc.proc_init)
    if desc.grammar_rows is not None:
        s.grammar_rows, s.grammar_mask = desc.grammar_rows.astype(np.int64), desc.grammar_mask.astype(np.int32)
    if desc.plp_idx is not None:
        s.plp_idx, s.plp_target = desc.plp_idx.astype(np.int64), desc.plp_target.astype(np.int64)
    if not graph_bs:
        s.token_write = token_write
        s.columns = {c.name: columns[c.name].astype(c.staged) for c in COLUMNS if c.group in s.groups}
        return s
    variant = {c.name: columns[c.name] for c in COLUMNS if c.group in s.groups and c.group in VARIANT_GROUPS}
    if not variant:
        return s
    picked = rows_to_redraw(desc.batch_size, variant, state.scratch_row, desc.grammar_rows)
    if picked is not None:  # few rows of a large batch: those rows alone, eagerly
        draw = {c.name: columns[c.name] for c in COLUMNS if c.group == DRAW}
        s.redraw = redraw_inputs(picked, {**draw, **variant}, positions, token_write, desc.grammar_rows)
    else:
        s.sampler_io = SAMPLER_IO.pack(graph_bs, desc.batch_size, variant, sampler_io_pads(state.scratch_row))
    return s
