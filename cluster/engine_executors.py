"""The executors over real engines (the Executor protocol is in cluster/executor.py): a replica of one
rank, and rank 0 of a tensor-parallel group, which broadcasts each step to the followers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from cluster.executor import ReplicaBrokenError
from worker.batch import BatchDesc, StepOutput
from worker.comm import Keepalive, destroy_tensor_parallel
from worker.engine import Engine


class LocalExecutor:
    """A replica of one rank."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def launch(self, desc: BatchDesc) -> StepOutput:
        return self.engine.forward(desc)

    def wait(self, out: StepOutput) -> None:
        out.done.synchronize()

    def keepalive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 of a group: broadcasts each step before launching it itself, so followers start at once."""

    def __init__(self, engine: Engine, keepalive_s: float) -> None:
        self.engine = engine
        self.comm = engine.tp.comm
        self.keepalive_s = keepalive_s
        self._last_broadcast = time.monotonic()
        self._busy_since: float | None = None

    def launch(self, desc: BatchDesc) -> StepOutput:
        try:
            with self._busy():
                self._broadcast(desc)
                return self.engine.forward(desc)
        except RuntimeError as e:  # gloo/NCCL errors: a peer is gone or stalled
            raise ReplicaBrokenError(f"tensor-parallel group failed: {e}") from e

    def wait(self, out: StepOutput) -> None:
        try:
            with self._busy():
                out.done.synchronize()
        except RuntimeError as e:  # an NCCL abort or a CUDA error surfaces here
            raise ReplicaBrokenError(f"tensor-parallel group failed: {e}") from e

    def stuck_for(self) -> float:
        """Seconds the current launch or wait has lasted (0 when neither runs). On GPUs a collective
        whose peer died does not fail: its kernel spins on the device and the host blocks in whatever
        waits on it next, so the replica's watchdog looks here instead."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def keepalive(self) -> None:
        """While idle, tells the followers (waiting for the next step) that rank 0 lives, well before
        their wait would time out as a stalled collective."""
        if time.monotonic() - self._last_broadcast > self.keepalive_s:
            try:
                self._broadcast(Keepalive())
            except RuntimeError as e:
                raise ReplicaBrokenError(f"tensor-parallel group failed: {e}") from e

    def _broadcast(self, message: BatchDesc | Keepalive) -> None:
        self.comm.broadcast_desc(message)
        self._last_broadcast = time.monotonic()

    def shutdown(self) -> None:
        try:
            self.comm.broadcast_desc(None)
        except RuntimeError:
            pass  # the followers are gone already
        destroy_tensor_parallel()
