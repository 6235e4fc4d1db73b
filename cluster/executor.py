"""Executors run a batch description on every rank of a replica. Here: a replica of one rank."""

from __future__ import annotations

from worker.batch import BatchDesc, StepOutput
from worker.engine import Engine


class LocalExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def launch(self, desc: BatchDesc) -> StepOutput:
        return self.engine.forward(desc)

    def shutdown(self) -> None:
        pass
