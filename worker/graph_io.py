"""The per-row blocks that a graph-replayed decode step stages and copies into the CUDA graphs' static
buffers (worker/cuda_graph.py): their layout, their packing on the host and their views on the device.

A block of a bucket of `bs` rows holds one row of `bs` values per field: the int64 rows first (every
view then starts aligned), then the float32 rows. Past a step's real rows each field holds its pad,
what a padded row reads: token 0 at position 0, its KV into the scratch page, its token into the token
pool's scratch cell, greedy, and no filter or processor (the processors' scratch row)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

import numpy as np
import torch

from worker.sampling.columns import DRAW, VARIANT_GROUPS, Column, column_pads, columns_of


@dataclass(frozen=True)
class Block:
    ints: tuple[str, ...]  # int64 rows
    floats: tuple[str, ...]  # float32 rows

    @staticmethod
    def of(forward: tuple[str, ...], columns: tuple[Column, ...]) -> Block:
        """`forward`'s int rows, then the columns' (integer and bool columns as int64 rows)."""
        return Block(
            forward + tuple(c.name for c in columns if not c.is_float), tuple(c.name for c in columns if c.is_float)
        )

    def nbytes(self, bs: int) -> int:
        return (8 * len(self.ints) + 4 * len(self.floats)) * bs

    def pack(self, bs: int, n: int, values: Mapping[str, np.ndarray], pads: Mapping[str, float]) -> np.ndarray:
        """The block (uint8) of a bucket of `bs` rows, `n` of them real: each field's values for the real
        rows (its pad where `values` lacks it), then its pad."""
        block = np.empty(self.nbytes(bs), dtype=np.uint8)
        ni = 8 * len(self.ints) * bs
        ints = block[:ni].view(np.int64).reshape(len(self.ints), bs)
        floats = block[ni:].view(np.float32).reshape(len(self.floats), bs)
        for table, names in ((ints, self.ints), (floats, self.floats)):
            for i, name in enumerate(names):
                table[i, :n] = values[name] if name in values else pads[name]
                table[i, n:] = pads[name]
        return block

    def views(self, buffer: torch.Tensor, bs: int) -> dict[str, torch.Tensor]:
        """Each field's row of a bucket of `bs` rows, as views of the uint8 `buffer` the block is copied into."""
        ni = 8 * len(self.ints) * bs
        ints = buffer[:ni].view(torch.int64).view(len(self.ints), bs)
        floats = buffer[ni : self.nbytes(bs)].view(torch.float32).view(len(self.floats), bs)
        return {
            **{name: ints[i] for i, name in enumerate(self.ints)},
            **{name: floats[i] for i, name in enumerate(self.floats)},
        }


# the per-step block: the forward's cells and positions, where each row's token goes and at what
# position it samples, and the draw's columns
IO = Block.of(("token_read", "positions", "out_loc", "token_write", "sample_pos"), columns_of(DRAW))
# the second block, of a step that filters or processes: the columns of the variant graphs
SAMPLER_IO = Block.of((), columns_of(*VARIANT_GROUPS))


def io_pads(scratch_loc: int, scratch_cell: int) -> dict[str, float]:
    return {
        "token_read": 0,
        "positions": 0,
        "out_loc": scratch_loc,
        "token_write": scratch_cell,
        "sample_pos": 0,
        **{c.name: c.pad for c in columns_of(DRAW)},
    }


@cache
def sampler_io_pads(scratch_row: int) -> Mapping[str, float]:
    pads = column_pads(scratch_row)
    return MappingProxyType({name: pads[name] for name in SAMPLER_IO.ints + SAMPLER_IO.floats})
