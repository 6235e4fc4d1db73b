"""A scheduler with no model: an Executor whose sampled tokens come from a script, so admission, the
caches, batch building and preemption can be exercised (and timed) at the scheduler's own API, in
microseconds per step. Used by tests (through conftest's `scripted` fixture) and by bench/."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.config import SchedulerConfig
from cluster.messages import AddRequest, TokenDelta
from cluster.sampling_params import SamplingParams
from cluster.scheduler.req import Req
from cluster.scheduler.scheduler import Scheduler
from worker.batch import BatchDesc, StepOutput
from worker.stream import NullEvent

EOS = 0
TOKEN = 7  # what a script samples when it does not end the request


class ScriptedExecutor:
    """Samples `tokens(desc)` for each step (one id per request, in the description's order), at
    once, like an infinitely fast device. Keeps every description it launched."""

    def __init__(self, tokens: Callable[[BatchDesc], Sequence[int]] | None = None) -> None:
        self.tokens = tokens or (lambda desc: [TOKEN] * desc.batch_size)
        self.launched: list[BatchDesc] = []
        self.fail_next: Exception | None = None  # raised by the next launch instead of running it

    def launch(self, desc: BatchDesc) -> StepOutput:
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        self.launched.append(desc)
        return StepOutput(next_tokens=np.asarray(self.tokens(desc), dtype=np.int32), done=NullEvent())

    def wait(self, out: StepOutput) -> None:
        pass


def eos_with_probability(p: float, seed: int = 0) -> Callable[[BatchDesc], list[int]]:
    """A script that ends each request after a geometric number of tokens (mean 1/p)."""
    rng = random.Random(seed)
    return lambda desc: [EOS if rng.random() < p else TOKEN for _ in range(desc.batch_size)]


@dataclass
class ScriptedScheduler:
    """A Scheduler over a ScriptedExecutor, with every delta it sent."""

    scheduler: Scheduler
    executor: ScriptedExecutor
    deltas: list[TokenDelta] = field(default_factory=list)
    ended: dict[int, str] = field(default_factory=dict)  # finish reason of every request that ended
    preempted: dict[int, int] = field(default_factory=dict)  # times each ended request was preempted

    def submit(self, uid: int, input_ids: list[int], max_tokens: int | None = 8, **params) -> None:
        params.setdefault("temperature", 0.0)
        self.scheduler.submit(AddRequest(uid, input_ids, SamplingParams(max_tokens=max_tokens, **params)))

    def run(self, max_steps: int = 100_000) -> int:
        """Steps until nothing is left to do; returns the number of steps."""
        for n in range(max_steps):
            if not self.scheduler.has_work:
                return n
            self.scheduler.step()
        raise AssertionError(f"work left after {max_steps} steps")

    def tokens(self, uid: int) -> list[int]:
        return [d.token for d in self.deltas if d.uid == uid and d.token is not None]

    def check(self) -> None:
        """Every page and request slot is back where it belongs and no request is left."""
        self.scheduler.check_integrity()
        stats = self.scheduler.snapshot()
        assert stats.live == 0 and stats.request_slots_free == stats.request_slots_total


def scripted_scheduler(
    tokens: Callable[[BatchDesc], Sequence[int]] | None = None,
    *,
    num_pages: int = 256,
    page_size: int = 4,
    max_running_reqs: int = 8,
    max_seq_len: int = 1024,
    eos_ids: set[int] | None = None,
    keep_deltas: bool = True,
    **config,
) -> ScriptedScheduler:
    """`config`: SchedulerConfig fields (overlap, cache_type, max_extend_tokens, decode_reserve_tokens).
    Benchmarks pass keep_deltas=False: a list growing by every delta would be timed too (its garbage
    collection most of all)."""
    executor = ScriptedExecutor(tokens)
    deltas: list[TokenDelta] = []
    ended: dict[int, str] = {}
    preempted: dict[int, int] = {}

    def on_finish(req: Req, reason: str) -> None:
        ended[req.uid], preempted[req.uid] = reason, req.num_preempted

    scheduler = Scheduler(
        SchedulerConfig(**config),
        executor,
        num_pages=num_pages,
        page_size=page_size,
        max_running_reqs=max_running_reqs,
        max_seq_len=max_seq_len,
        eos_ids={EOS} if eos_ids is None else eos_ids,
        on_output=deltas.extend if keep_deltas else lambda step_deltas: None,
        on_finish=on_finish,
    )
    return ScriptedScheduler(scheduler, executor, deltas, ended, preempted)
