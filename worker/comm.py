"""The tensor-parallel communicator on torch.distributed: NCCL (GPU) or gloo (CPU) for the model's
collectives, plus a gloo group on which rank 0 broadcasts each step's batch description."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from worker.batch import BatchDesc
from worker.parallel import TPGroup


@dataclass(frozen=True)
class Keepalive:
    """Sent by an idle rank 0 in place of a step: followers waiting for the next step learn that rank 0
    lives, well before their wait would time out as a stalled collective."""


def free_address(host: str) -> str:
    """host:port with a port free right now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


class TorchDistComm:
    def __init__(self, device_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device) -> None:
        self.device_group, self.cpu_group, self.device = device_group, cpu_group, device
        self.size = dist.get_world_size(device_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value, for sizes all ranks must share. At start-up, so on the
        device group: its timeout allows for ranks that load at different speeds."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.device_group)
        return int(t.item())

    def broadcast_desc(self, desc: BatchDesc | Keepalive | None) -> BatchDesc | Keepalive | None:
        """Rank 0 sends the step (None: stop); the others receive it."""
        box = [desc]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def init_tensor_parallel(rank: int, size: int, address: str, device: torch.device, timeout_s: float,
                         startup_timeout_s: float = 600.0) -> TPGroup:
    """Joins the replica's group (blocks until every rank has joined).

    Two groups: the device group (NCCL on GPUs, gloo on CPUs) for the model's collectives and for
    start-up, whose timeout allows for one rank loading a checkpoint slower than another; and a gloo
    group for the step broadcast, whose timeout_s bounds how long a follower waits for a rank 0 that
    died. A dead or stalled rank in the middle of a step is caught by rank 0's watchdog
    (cluster.replica), after timeout_s too: on GPUs its collective never fails, it spins."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is None:  # NCCL binds the group to one indexed device
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=max(startup_timeout_s, timeout_s)),
                            device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    comm = TorchDistComm(dist.group.WORLD, cpu_group, device)
    if backend == "nccl":
        # NCCL connects peers on their first collective; do it now, while every rank is known alive,
        # so a rank that dies later cannot leave rank 0 in a minute of connection retries
        comm.all_gather(comm.all_reduce(torch.ones(size, device=device)))
        torch.cuda.synchronize(device)
    return TPGroup(rank, size, comm)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
