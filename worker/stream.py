"""CUDA streams and events, with no-op stand-ins of the same interface on the CPU (where every
operation has finished by the time it returns), so the scheduling logic is the same on both."""

from __future__ import annotations

import contextlib
import time

import torch

# seconds the host has spent blocked on device events (wait_for), process-wide: a benchmark reads it
# before and after a window to tell the host's own work from its waits
host_wait_s = 0.0


class NullEvent:
    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NullStream:
    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


def new_stream(device: torch.device) -> torch.cuda.Stream | NullStream:
    return torch.cuda.Stream(device=device) if device.type == "cuda" else NullStream()


def new_event(device: torch.device) -> torch.cuda.Event | NullEvent:
    return torch.cuda.Event() if device.type == "cuda" else NullEvent()


def use_stream(stream: torch.cuda.Stream | NullStream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def wait_for(event: torch.cuda.Event | NullEvent) -> None:
    """event.synchronize(), its time counted in host_wait_s."""
    global host_wait_s
    start = time.perf_counter()
    event.synchronize()
    host_wait_s += time.perf_counter() - start
