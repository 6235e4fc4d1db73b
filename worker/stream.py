"""CUDA streams and events, with no-op stand-ins of the same interface on the CPU (where every
operation has finished by the time it returns), so the scheduling logic is the same on both."""

from __future__ import annotations

import contextlib
import time

import torch


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


class _StreamScope:
    """torch.cuda.stream(stream) for a stream of the current device, without its device lookups (on a
    slow host, torch.cuda.stream and a record() on the current stream cost several microseconds each
    in is_available and device-index checks; a decode step enters two scopes)."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> torch.cuda.Stream:
        self.prev = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)


def use_stream(stream: torch.cuda.Stream | NullStream) -> contextlib.AbstractContextManager:
    return _StreamScope(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The current stream of a CUDA device, looked up without torch's device checks; None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device.index if device.index is not None else torch.cuda.current_device())


class HostWaits:
    """The host's waits on device events, and the seconds they took: an engine keeps one, which its
    staging rings, its attention plans and its executor's waits for results all wait through, so a
    benchmark can read `seconds` before and after a window to tell the host's own work from its waits."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    def wait(self, event: torch.cuda.Event | NullEvent) -> None:
        """event.synchronize(), its time counted in `seconds`."""
        start = time.perf_counter()
        event.synchronize()
        self.seconds += time.perf_counter() - start
