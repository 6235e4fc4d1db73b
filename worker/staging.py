"""Pinned host staging for a step's small arrays: they are packed into one persistent pinned buffer and
reach the device in a single copy, instead of one pinned allocation and one copy per array.

A pinned buffer must not be rewritten while a copy from it may still be in flight, and the device
twin must not be rewritten while a kernel may still read it. So the buffers form a ring, and each
slot carries an event that its user records after the last use; `upload` waits on it (on the host)
before reusing the slot. Under the overlap loop the host has already waited for that step's results
by then, so the wait costs nothing. On the CPU there is no copy: the views are the host arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.stream import HostWaits, new_event

_ALIGN = 16  # so that every view starts on a boundary of its element size
_MAX_LAYOUTS = 64  # cached view sets per slot


class Staged:
    """One slot's arrays: `host[name]` (pinned, for host-side consumers such as planners) and
    `device[name]`. Call `release(stream)` once the last reader on `stream` has been enqueued."""

    def __init__(self, slot: _Slot, host: dict[str, torch.Tensor], device: dict[str, torch.Tensor]) -> None:
        self._slot = slot
        self.host = host
        self.device = device

    def release(self, stream: object = None) -> None:
        self._slot.event.record(stream)
        self._slot.in_use = False


@dataclass(frozen=True)
class _Views:
    """One layout's typed views of a slot, and the slot's used span to copy (None on the CPU)."""

    host: dict[str, torch.Tensor]
    device: dict[str, torch.Tensor]
    offsets: list[int]
    copy: tuple[torch.Tensor, torch.Tensor] | None


class _Slot:
    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.event = new_event(device)
        self.in_use = False
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        on_gpu = self.device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=on_gpu)
        self.dev = torch.empty(capacity, dtype=torch.uint8, device=self.device) if on_gpu else self.host
        self.host_np = self.host.numpy()
        # the typed views of each layout seen (a decode step's arrays have the same names, sizes and
        # dtypes step after step): made once, since each view costs the host more than the packing
        self.views: dict[tuple, _Views] = {}


class PinnedStaging:
    def __init__(
        self, device: torch.device, depth: int = 2, capacity: int = 1 << 20, waits: HostWaits | None = None
    ) -> None:
        """`waits`: where the waits for a slot to be free are counted (the engine's)."""
        self.device = device
        self.waits = waits or HostWaits()
        self.slots = [_Slot(device, capacity) for _ in range(depth)]
        self.next = 0

    def upload(self, arrays: dict[str, np.ndarray]) -> Staged:
        """Packs `arrays` into the next slot and copies them to the device on the current stream."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if slot.in_use:
            raise RuntimeError("a staging slot was reused before the step that held it released it")
        self.waits.wait(slot.event)  # the step that last used this slot is done with it
        layout = tuple((name, a.dtype, a.nbytes) for name, a in arrays.items())
        if (views := slot.views.get(layout)) is None:
            if len(slot.views) >= _MAX_LAYOUTS:  # prefill steps vary: keep the cache bounded
                slot.views.clear()
            offsets, end = [], 0
            for a in arrays.values():
                offsets.append(end)
                end += -(-a.nbytes // _ALIGN) * _ALIGN
            if end > slot.host.numel():
                slot.resize(max(end, 2 * slot.host.numel()))
            host, device = {}, {}
            for (name, a), off in zip(arrays.items(), offsets):
                dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype
                host[name] = slot.host[off : off + a.nbytes].view(dtype)
                device[name] = slot.dev[off : off + a.nbytes].view(dtype)
            copy = (slot.dev[:end], slot.host[:end]) if slot.dev is not slot.host and end else None
            views = slot.views[layout] = _Views(host, device, offsets, copy)
        for a, off in zip(arrays.values(), views.offsets):
            slot.host_np[off : off + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
        if views.copy is not None:
            dst, src = views.copy
            dst.copy_(src, non_blocking=True)
        slot.in_use = True
        return Staged(slot, views.host, views.device)


def _leaves(record: object, path: tuple, out: list) -> None:
    """Appends (holder, key, path, array) for every numpy array under `record`: a dataclass's fields and
    a dict's values, recursively."""
    for key, value in record.items() if type(record) is dict else vars(record).items():
        if value is None:
            continue
        if type(value) is np.ndarray:
            out.append((record, key, path + (key,), value))
        elif type(value) is dict or hasattr(type(value), "__dataclass_fields__"):
            _leaves(value, path + (key,), out)


def upload_record(staging: PinnedStaging, record: object) -> Staged:
    """Uploads every numpy array of `record` (a dataclass whose fields may be arrays, dicts of them or
    such dataclasses) in one copy, as PinnedStaging.upload does, and puts each array's device view,
    shaped as the array was, in its place."""
    leaves: list = []
    _leaves(record, (), leaves)
    staged = staging.upload({path: a for _, _, path, a in leaves})
    views = staged.device
    for holder, key, path, a in leaves:
        view = views[path] if a.ndim == 1 else views[path].view(a.shape)
        if type(holder) is dict:
            holder[key] = view
        else:
            setattr(holder, key, view)
    return staged
