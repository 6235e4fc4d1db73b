"""Every expert's weights stacked into one parameter per projection, each rank holding its slice of the
intermediate dimension; checkpoints store one tensor per expert, which the loader addresses by
(expert index, part) shard ids."""

from __future__ import annotations

import torch
from torch import nn

from worker.parallel import TPGroup


class ExpertGateUp(nn.Module):
    """weight [E, 2 * I_local, H]: each expert's gate rows then its up rows (shard ids (e, 0), (e, 1))."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(intermediate, "moe_intermediate_size")
        self.weight = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.shard_ids = {(e, part) for e in range(num_experts) for part in (0, 1)}

    def weight_loader(self, param: nn.Parameter, full, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        piece = full.narrow(0, self.tp.rank * self.local, self.local)
        param.data[expert].narrow(0, part * self.local, self.local).copy_(piece)


class ExpertDown(nn.Module):
    """weight [E, H, I_local]: each expert's down projection, split on its input columns."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(intermediate, "moe_intermediate_size")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        self.shard_ids = {(e, 0) for e in range(num_experts)}

    def weight_loader(self, param: nn.Parameter, full, shard_id: tuple[int, int]) -> None:
        param.data[shard_id[0]].copy_(full.narrow(1, self.tp.rank * self.local, self.local))


class Experts(nn.Module):
    """The stacked experts of one block, named so that `experts.{e}.gate_proj` etc. land in them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = ExpertGateUp(num_experts, hidden, intermediate, tp)
        self.down_proj = ExpertDown(num_experts, hidden, intermediate, tp)
