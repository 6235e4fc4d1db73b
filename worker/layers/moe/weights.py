"""Every expert's weights stacked into one parameter per projection, each rank holding its slice of the
intermediate dimension. Published checkpoints store one tensor per expert, which the loader addresses by
(expert index, part) shard ids; transformers' own layout stacks every expert's projection in one tensor
(what `save_pretrained(save_original_format=False)` writes, and a GGUF file's folder holds), which the
loader reads one expert's part at a time (`stacked_parts`), as if it were published."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from worker.checkpoint_error import check_shape
from worker.parallel import TPGroup

# the dtype stacked expert weights are made in (None: torch's default): an FP8 checkpoint's experts are made
# e4m3 where they stay so, so that a model building never holds them in bf16 (twice the memory)
_MADE_IN: ContextVar[torch.dtype | None] = ContextVar("experts_made_in", default=None)


@contextmanager
def experts_made_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Stacked expert weights made inside are `dtype` (None: torch's default)."""
    token = _MADE_IN.set(dtype)
    try:
        yield
    finally:
        _MADE_IN.reset(token)


class ExpertPart:
    """One expert's part of a checkpoint tensor stacking every expert's ([E, rows, columns]): rows
    [first_row, first_row + rows) of expert `expert`, read as a per-expert tensor is, in the slices a
    weight loader asks for (whole, or narrowed on one dimension)."""

    def __init__(self, stacked, expert: int, first_row: int, rows: int) -> None:
        self._stacked, self._expert, self._first = stacked, expert, first_row
        self.shape = (rows, tuple(stacked.shape)[2])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows, cols = slice(self._first, self._first + self.shape[0]), slice(None)
        if dim == 0:
            rows = slice(self._first + start, self._first + start + length)
        else:
            cols = slice(start, start + length)
        return self._stacked[self._expert, rows, cols]

    def __getitem__(self, index) -> torch.Tensor:
        if index != slice(None):
            raise TypeError(f"an expert's part of a stacked tensor is read whole or narrowed, not at {index!r}")
        return self.narrow(0, 0, self.shape[0])


class ExpertGateUp(nn.Module):
    """weight [E, 2 * I_local, H]: each expert's gate rows then its up rows (shard ids (e, 0), (e, 1))."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(intermediate, "moe_intermediate_size")
        self.weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.local, hidden, dtype=_MADE_IN.get()), requires_grad=False
        )
        self.shard_ids = {(e, part) for e in range(num_experts) for part in (0, 1)}

    def weight_loader(self, param: nn.Parameter, full, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        check_shape(full, (self.local * self.tp.size, param.shape[2]), "weight")
        piece = full.narrow(0, self.tp.rank * self.local, self.local)
        param.data[expert].narrow(0, part * self.local, self.local).copy_(piece)

    def stacked_parts(self, full) -> Iterator[tuple[tuple[int, int], ExpertPart]]:
        """Each expert's gate and up (shard ids (e, 0), (e, 1)) in a tensor stacking them all: [E, 2I, H],
        an expert's gate rows then its up rows."""
        experts, _, hidden = self.weight.shape
        inter = self.local * self.tp.size
        check_shape(full, (experts, 2 * inter, hidden), "stacked experts' gate and up")
        for e in range(experts):
            for part in (0, 1):
                yield (e, part), ExpertPart(full, e, part * inter, inter)


class ExpertDown(nn.Module):
    """weight [E, H, I_local]: each expert's down projection, split on its input columns."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(intermediate, "moe_intermediate_size")
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, self.local, dtype=_MADE_IN.get()), requires_grad=False
        )
        self.shard_ids = {(e, 0) for e in range(num_experts)}

    def weight_loader(self, param: nn.Parameter, full, shard_id: tuple[int, int]) -> None:
        check_shape(full, (param.shape[1], self.local * self.tp.size), "weight")
        param.data[shard_id[0]].copy_(full.narrow(1, self.tp.rank * self.local, self.local))

    def stacked_parts(self, full) -> Iterator[tuple[tuple[int, int], ExpertPart]]:
        """Each expert's down (shard id (e, 0)) in a tensor stacking them all: [E, H, I]."""
        experts, hidden, _ = self.weight.shape
        check_shape(full, (experts, hidden, self.local * self.tp.size), "stacked experts' down")
        for e in range(experts):
            yield (e, 0), ExpertPart(full, e, 0, hidden)


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' float32 scales beside their e4m3 weights (worker/quant/experts.py makes them): gate_up
    [E, 2I, KG] and down [E, H, KG'], row n's weight at column k standing for e4m3 * scale[e, n, k // group]
    (group 0: one scale a row). A group is a power of two of at least 16 columns, narrower than the rank's
    weight."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_group: int
    down_group: int


class Experts(nn.Module):
    """The stacked experts of one block, named so that `experts.{e}.gate_proj` etc. land in them. FP8
    experts hold e4m3 weights, and each projection its scales (`fp8_scales`, `fp8_group`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = ExpertGateUp(num_experts, hidden, intermediate, tp)
        self.down_proj = ExpertDown(num_experts, hidden, intermediate, tp)

    def scales(self) -> ExpertScales | None:
        """The FP8 experts' scales; None: the weights are in the model's dtype."""
        gu, dn = self.gate_up_proj, self.down_proj
        if getattr(gu, "fp8_scales", None) is None:
            return None
        return ExpertScales(gu.fp8_scales, dn.fp8_scales, gu.fp8_group, dn.fp8_group)
