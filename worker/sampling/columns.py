"""The per-row sampling columns of a step, declared once: what the batch description carries, the
device stages, the graphs' sampler buffers hold and the sampler reads are all derived from here.

A column belongs to a group, the unit a step turns on or off as a whole:
- draw: the Gumbel-max draw (every row greedy: none staged, the argmax);
- filter: top-k and top-p (a sort);
- min_p: min-p (no sort);
- procs: the logits processors (penalties, biases, min_tokens' ban), over the request slots' state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

import numpy as np

DRAW, FILTER, MIN_P, PROCS = "draw", "filter", "min_p", "procs"
GROUPS = (DRAW, FILTER, MIN_P, PROCS)
# the groups a replayed decode step redraws in a variant graph (the head's draw covers the other)
VARIANT_GROUPS = (FILTER, MIN_P, PROCS)
# a pad that stands for the processors' scratch row (known once the engine sizes its state)
SCRATCH_ROW = "scratch_row"


@dataclass(frozen=True)
class Column:
    name: str
    dtype: np.dtype  # in the batch description (and on the wire)
    staged: np.dtype  # on the device, as the step sampler reads it
    pad: float | int | str  # what a row that does not use its group holds (SCRATCH_ROW: the scratch row)
    group: str

    @property
    def is_float(self) -> bool:
        return np.issubdtype(self.dtype, np.floating)


_I64, _I32, _F32, _U8, _BOOL = (np.dtype(t) for t in (np.int64, np.int32, np.float32, np.uint8, np.bool_))

COLUMNS = (
    Column("temperature", _F32, _F32, 0.0, DRAW),  # 0 is greedy
    Column("seeds", _I64, _I64, 0, DRAW),  # with the row's position, the draw's key
    Column("top_p", _F32, _F32, 1.0, FILTER),
    Column("top_k", _I32, _I32, -1, FILTER),  # <= 0 is off
    Column("min_p", _F32, _F32, 0.0, MIN_P),
    Column("state_row", _I32, _I64, SCRATCH_ROW, PROCS),  # the slot whose state the row reads and updates
    Column("presence", _F32, _F32, 0.0, PROCS),
    Column("frequency", _F32, _F32, 0.0, PROCS),
    Column("repetition", _F32, _F32, 1.0, PROCS),  # 1 is off
    Column("ban_stop", _U8, _BOOL, 0, PROCS),  # 1 while the row's min_tokens is not reached
)


@cache
def columns_of(*groups: str) -> tuple[Column, ...]:
    return tuple(c for c in COLUMNS if c.group in groups)


@cache
def column_pads(scratch_row: int) -> Mapping[str, float | int]:
    """Every column's pad, the scratch row resolved."""
    return MappingProxyType({c.name: scratch_row if c.pad == SCRATCH_ROW else c.pad for c in COLUMNS})


def rows_using(group: str, values: Mapping[str, np.ndarray], scratch_row: int) -> np.ndarray:
    """bool [B]: the rows whose values of `group`'s columns make them use it."""
    if group == DRAW:
        return ~(values["temperature"] <= 0)
    if group == FILTER:
        return (values["top_k"] > 0) | (values["top_p"] < 1)
    if group == MIN_P:
        return values["min_p"] > 0
    return values["state_row"] != scratch_row
