"""Whether speculation pays, measured: the decode steps' output tokens a row and second with it and
without it, taken as the steps are handled, and the faster way kept.

Speculation pays when the tokens a verify step keeps outweigh what it costs: the proposer's work (a
draft model's forwards, k of them a step), the verify rows, and the overlap a speculating request gives
up while it waits for its own result. None of that is known before it runs: a draft as large as the
model never pays, a small one with a close distribution pays several times over, and acceptance moves
with the text. So the gate measures both ways in turn, a probe of a few steps each, keeps the faster
for a hold of steps, then probes the slower again: a loser that loses again is held off twice as long
(up to max_hold), one that wins takes over. A probe's first step is not counted (the step before it
ran the other way: a draft catches up, an overlap fills or drains). A measurement taken at a batch
size at least twice or at most half the current one is taken again, once the hold has run first_hold
steps (in a run's tail the batch halves every few dozen steps, and each probe costs: a draft model first
catches up with every token decoded since its last proposals).

Only the rate of a decode step that follows another step handled closely is counted: tokens it
emitted, over its rows, over the time since the step handled before it (in the overlap loop the time
a step takes, in the normal loop the host's and device's work on it)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# the rates a probe measures (its first step, run after the other way's, is not one of them)
PROBE_STEPS = 3
FIRST_HOLD = 16  # steps the faster way runs before the slower is probed again; doubled per repeat win
MAX_HOLD = 1024
# a gap longer than this between two handled steps is idleness (no requests), not a step's time
MAX_STEP_S = 1.0


@dataclass
class _Way:
    """What is known of one way (speculating or not): its rate over its last probe_steps counted steps
    and the batch it ran at then."""

    rate: float | None = None  # output tokens a row and second: the median of the samples
    rows: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=PROBE_STEPS))


class SpecGate:
    def __init__(self, probe_steps: int = PROBE_STEPS, first_hold: int = FIRST_HOLD, max_hold: int = MAX_HOLD) -> None:
        self.probe_steps, self.first_hold, self.max_hold = probe_steps, first_hold, max_hold
        self.ways = {True: _Way(samples=deque(maxlen=probe_steps)), False: _Way(samples=deque(maxlen=probe_steps))}
        self.speculating = True  # the way steps run now: the first probe speculates
        self.probing = True  # else holding
        self.held_way: bool | None = None  # the way of the last hold
        self.hold = first_hold
        self.steps = 0  # in this probe or hold
        self.skip = 1  # steps of this way still to pass uncounted
        self.last_handled: float | None = None
        self.switches = 0

    def speculates(self, rows: int) -> bool:
        """The way of the next decode step of `rows` requests."""
        if not self.probing:
            self.steps += 1
            stale = self.steps >= self.first_hold and _stale(self.ways[not self.speculating], rows)
            if self.steps > self.hold or stale:
                self._run(not self.speculating, probing=True)
        return self.speculating

    def handled(self, now: float, speculated: bool | None, rows: int, tokens: int) -> None:
        """A step was handled at `now`: a decode step of `rows` rows run the way `speculated` (None: a step
        with prompt tokens, not counted) that emitted `tokens`."""
        last, self.last_handled = self.last_handled, now
        if speculated is None or speculated != self.speculating or last is None or not rows:
            return
        if self.skip:
            self.skip -= 1
            return
        if now - last > MAX_STEP_S:
            return
        way = self.ways[speculated]
        way.samples.append(tokens / rows / max(now - last, 1e-9))
        if len(way.samples) < self.probe_steps:
            return
        way.rate, way.rows = statistics.median(way.samples), rows
        if self.probing:
            self._decide(rows)

    def _decide(self, rows: int) -> None:
        """A probe ended: probe the other way where its rate is unknown or stale, else hold the faster
        (twice as long as the last hold where the same way holds again)."""
        now_way, other = self.speculating, self.ways[not self.speculating]
        if other.rate is None or _stale(other, rows):
            self._run(not now_way, probing=True)
            return
        best = now_way if self.ways[now_way].rate >= other.rate else not now_way
        self.hold = min(2 * self.hold, self.max_hold) if best == self.held_way else self.first_hold
        self.held_way = best
        self._run(best, probing=False)

    def _run(self, way: bool, probing: bool) -> None:
        if way != self.speculating:
            self.switches += 1
            self.skip = 1
            self.ways[way].samples.clear()
        self.speculating, self.probing, self.steps = way, probing, 0


def _stale(way: _Way, rows: int) -> bool:
    """A rate measured at a batch at least twice or at most half as large as this one."""
    return way.rate is not None and not (way.rows / 2 < rows < way.rows * 2)
