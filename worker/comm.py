"""The tensor-parallel communicator on torch.distributed: NCCL (GPU) or gloo (CPU) for the model's
collectives, plus a gloo group on which rank 0 broadcasts each step's batch description, packed into
a fixed-size byte tensor rather than pickled."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from worker.batch import LAYOUT_LEN, BatchDesc, desc_layout, pack_desc, packed_nbytes, unpack_desc
from worker.parallel import TPGroup


class CollectiveError(RuntimeError):
    """A collective or the step broadcast failed (a peer is gone, or it timed out): the group is unusable."""


@dataclass(frozen=True)
class Keepalive:
    """Sent by an idle rank 0 in place of a step: followers waiting for the next step learn that rank 0
    lives, well before their wait would time out as a stalled collective."""


def free_address(host: str) -> str:
    """host:port with a port free right now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


class DescChannel:
    """Rank 0's step broadcast. Every message is one broadcast of a fixed MESSAGE_BYTES: an int64
    header (the kind, then the description's layout) and the packed description after it; one whose
    payload does not fit there (a long prefill) follows in a second broadcast of its exact size. The
    buffers are allocated once (the overflow one grows), and what a follower receives is unpacked into
    views of them: valid until its next receive, which the engine never outlives (it copies a step's
    arrays before forward returns). On gloo a broadcast costs about the same up to 32 KiB (docs/BENCHMARKS.md),
    which holds a decode step of about 900 requests.

    Rank 0 only posts its broadcasts and goes on to launch the step; it waits for them to complete
    before it next writes the buffers (by then, a step later, they long have), so that a follower's
    receive is no longer serialized before rank 0's own launch. A follower gone or stalled surfaces
    there, as the failed wait (or in the step's first collective, before it)."""

    MESSAGE_BYTES = 32 * 1024
    HEADER_BYTES = 8 * (1 + LAYOUT_LEN)
    INLINE_BYTES = MESSAGE_BYTES - HEADER_BYTES  # the largest payload sent in one broadcast
    STEP, KEEPALIVE, STOP = 0, 1, 2

    def __init__(self, group: dist.ProcessGroup, message_bytes: int = MESSAGE_BYTES) -> None:
        self.group = group  # message_bytes: the same on every rank; other sizes for benchmarks only
        self.message = torch.zeros(message_bytes, dtype=torch.uint8)
        raw = self.message.numpy()
        self._header, self._inline = raw[: self.HEADER_BYTES].view(np.int64), raw[self.HEADER_BYTES :]
        self.overflow = torch.empty(0, dtype=torch.uint8)
        self._in_flight: list[dist.Work] = []

    def send(self, desc: BatchDesc | Keepalive | None) -> None:
        """Posts the message; returns before it has arrived, but for the stop (None)."""
        self.wait_sent()
        if isinstance(desc, BatchDesc):
            layout = desc_layout(desc)
            self._header[0], self._header[1:] = self.STEP, layout
            nbytes = packed_nbytes(layout)
            payload = self._inline if nbytes <= len(self._inline) else self._overflow(nbytes)
            pack_desc(desc, layout, payload)
        else:
            self._header[0] = self.KEEPALIVE if isinstance(desc, Keepalive) else self.STOP
        with _collective("the step broadcast"):
            self._in_flight.append(dist.broadcast(self.message, src=0, group=self.group, async_op=True))
            if isinstance(desc, BatchDesc) and nbytes > len(self._inline):
                self._in_flight.append(dist.broadcast(self.overflow[:nbytes], src=0, group=self.group, async_op=True))
        if desc is None:
            self.wait_sent()

    def wait_sent(self) -> None:
        """Returns once rank 0's posted broadcasts have completed (raises if they failed)."""
        in_flight, self._in_flight = self._in_flight, []
        with _collective("the step broadcast"):
            for work in in_flight:
                work.wait()

    def receive(self) -> BatchDesc | Keepalive | None:
        with _collective("the step broadcast"):
            dist.broadcast(self.message, src=0, group=self.group)
        kind = self._header[0]
        if kind == self.KEEPALIVE:
            return Keepalive()
        if kind == self.STOP:
            return None
        layout = tuple(self._header[1:].tolist())
        nbytes = packed_nbytes(layout)
        payload = self._inline
        if nbytes > len(payload):
            payload = self._overflow(nbytes)
            with _collective("the step broadcast"):
                dist.broadcast(self.overflow[:nbytes], src=0, group=self.group)
        return unpack_desc(layout, payload)

    def _overflow(self, nbytes: int) -> np.ndarray:
        if len(self.overflow) < nbytes:
            self.overflow = torch.empty(1 << (nbytes - 1).bit_length(), dtype=torch.uint8)
        return self.overflow.numpy()


class TorchDistComm:
    """Rank 0 may hold a step's description back until its own forward reaches the step's first
    collective (`post_with_first_collective`): a failure of rank 0 before that point is then its own,
    the followers never saw the step, and the group stays in step."""

    def __init__(self, device_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device) -> None:
        self.device_group, self.cpu_group, self.device = device_group, cpu_group, device
        self.size = dist.get_world_size(device_group)
        self.rank = dist.get_rank(cpu_group)
        self.desc_channel = DescChannel(cpu_group)
        self._held: BatchDesc | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.post_held()
        with _collective("all_reduce"):
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.post_held()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with _collective("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value, for sizes all ranks must share. At start-up, so on the
        device group: its timeout allows for ranks that load at different speeds."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.device_group)
        return int(t.item())

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """x, elementwise the largest of every rank's (in place). At start-up, as min_over_ranks."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def broadcast_desc(self, desc: BatchDesc | Keepalive | None) -> BatchDesc | Keepalive | None:
        """Rank 0 sends the step (None: stop) and gets it back; the others receive it (their argument
        is unused)."""
        if self.rank == 0:
            self.desc_channel.send(desc)
            return desc
        return self.desc_channel.receive()

    def post_with_first_collective(self, desc: BatchDesc) -> None:
        """Rank 0: sends `desc` just before this rank's next collective (or at `post_held`)."""
        self._held = desc

    def post_held(self) -> None:
        """Sends the held description, if any."""
        if self._held is not None:
            desc, self._held = self._held, None
            self.broadcast_desc(desc)

    def withdraw_held(self) -> bool:
        """Drops the held description; True if it had not been sent (the followers never saw it)."""
        held, self._held = self._held is not None, None
        return held


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # gloo/NCCL (DistBackendError is one): a peer is gone or timed out
        raise CollectiveError(f"{what} failed: {e}") from e


def init_tensor_parallel(
    rank: int, size: int, address: str, device: torch.device, timeout_s: float, startup_timeout_s: float = 600.0
) -> TPGroup:
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
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=max(startup_timeout_s, timeout_s)),
        device_id=device if device.type == "cuda" else None,
    )
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
