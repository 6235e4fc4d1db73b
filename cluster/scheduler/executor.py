"""The scheduler's view of the engines: an Executor runs a batch description on every rank of a replica
and returns rank 0's output. The executors over real engines are in cluster/replica/engine_executors.py; tests
and benchmarks run the scheduler over scripted ones, with no model."""

from __future__ import annotations

from typing import Protocol

from worker.batch import BatchDesc, StepOutput


class ReplicaBrokenError(RuntimeError):
    """The replica's group cannot run steps any more (a rank died or a collective timed out)."""


class Executor(Protocol):
    def launch(self, desc: BatchDesc) -> StepOutput:
        """Starts the step on every rank; returns without waiting for it (on a GPU). Any exception but
        ReplicaBrokenError fails this step's requests only."""

    def wait(self, out: StepOutput) -> None:
        """Returns once `out` has reached the host; raises ReplicaBrokenError if it never can."""
