"""The executors over real engines (the Executor protocol is in cluster/scheduler/executor.py): a replica of one
rank, and rank 0 of a tensor-parallel group, which broadcasts each step to the followers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from cluster.scheduler.executor import ReplicaBrokenError
from worker.batch import BatchDesc, StepOutput
from worker.comm import CollectiveError, Keepalive, destroy_tensor_parallel
from worker.engine import Engine


class LocalExecutor:
    """A replica of one rank."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def launch(self, desc: BatchDesc) -> StepOutput:
        return self.engine.forward(desc)

    def wait(self, out: StepOutput) -> None:
        self.engine.host_waits.wait(out.done)

    def keepalive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 of a group. Which failures of a step break the replica, and which fail only the step:

    - the group's own failures (a collective or the step broadcast raises: a rank is gone or timed out;
      a wait that never ends, caught by the replica's watchdog) break it;
    - rank 0's forward raising before the followers were sent the step is rank 0's own (a kernel error,
      an out-of-memory): the step's requests fail, as at tp=1, and the group is still in step;
    - rank 0's forward raising after they were sent it breaks it: they run the step's collectives, and
      rank 0, which did not, would meet them with the next step's.

    So rank 0 sends an eager step's description just before its own first collective (the followers
    then start while its first layer runs). A step replayed from CUDA graphs (a decode graph, the extend
    graphs) issues its collectives inside them, unseen by the communicator, so its description goes out
    before it is launched."""

    def __init__(self, engine: Engine, keepalive_s: float) -> None:
        self.engine = engine
        self.comm = engine.tp.comm
        self.keepalive_s = keepalive_s
        self._last_broadcast = time.monotonic()
        self._busy_since: float | None = None

    def launch(self, desc: BatchDesc) -> StepOutput:
        with self._busy():
            try:
                if self._replayed(desc):
                    self._broadcast(desc)
                else:
                    self.comm.post_with_first_collective(desc)
                out = self.engine.forward(desc)
                self.comm.post_held()  # sent by now, unless the forward reached no collective
            except CollectiveError as e:
                self.comm.withdraw_held()
                raise ReplicaBrokenError(f"tensor-parallel group failed: {e}") from e
            except Exception as e:
                if self.comm.withdraw_held():
                    raise  # the followers never saw this step: it fails alone
                # rank 0 cannot tell how far it got: even past its last collective, it breaks the replica
                raise ReplicaBrokenError(
                    f"tensor-parallel group failed: rank 0 failed a step its followers "
                    f"were sent, which leaves the group out of step: "
                    f"{type(e).__name__}: {e}"
                ) from e
            self._last_broadcast = time.monotonic()
            return out

    def _replayed(self, desc: BatchDesc) -> bool:
        return self.engine.replays(desc)

    def wait(self, out: StepOutput) -> None:
        try:
            with self._busy():
                self.engine.host_waits.wait(out.done)
        except RuntimeError as e:  # an NCCL abort, or a CUDA error (sticky: the device is unusable)
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
            except CollectiveError as e:
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
