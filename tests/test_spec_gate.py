"""The speculation gate (speculative_adaptive): it measures the decode steps' tokens a row and second
with speculation and without, probes each in turn, keeps the faster, probes the slower again after a
hold that doubles while it keeps losing, takes over when the probed way wins, measures again when the
batch has changed size, and ignores prompt steps and idle gaps. Steps here are timed by a fake clock:
each way's rate is what the test says it is."""

from __future__ import annotations

import pytest
from helpers import checked_llm, encode_all, greedy

from cluster import SamplingParams
from cluster.scheduler.spec_gate import MAX_STEP_S, SpecGate


class Steps:
    """Runs decode steps through a gate: each takes `seconds[way]` and emits `tokens[way]` a row."""

    def __init__(self, gate: SpecGate, seconds: dict[bool, float], tokens: dict[bool, float], rows: int = 8):
        self.gate, self.seconds, self.tokens, self.rows = gate, seconds, tokens, rows
        self.now = 0.0
        self.ways: list[bool] = []
        gate.handled(self.now, None, rows, rows)  # a prompt step first: the clock's origin

    def run(self, n: int) -> list[bool]:
        ways = []
        for _ in range(n):
            way = self.gate.speculates(self.rows)
            self.now += self.seconds[way]
            self.gate.handled(self.now, way, self.rows, int(self.tokens[way] * self.rows))
            ways.append(way)
        self.ways += ways
        return ways


def _runs(ways: list[bool]) -> list[tuple[bool, int]]:
    """Runs of equal ways: [(way, length)]."""
    out: list[tuple[bool, int]] = []
    for w in ways:
        if out and out[-1][0] == w:
            out[-1] = (w, out[-1][1] + 1)
        else:
            out.append((w, 1))
    return out


def test_speculation_that_is_slower_is_held_off_longer_each_time_it_loses_again():
    gate = SpecGate(probe_steps=4, first_hold=16, max_hold=64)
    # speculating: 3 tokens a row in 5 ms; plainly: 1 in 1 ms (3x the rate)
    steps = Steps(gate, seconds={True: 0.005, False: 0.001}, tokens={True: 3, False: 1})
    runs = _runs(steps.run(400))
    # a probe is its uncounted first step and 4 counted ones
    assert runs[0] == (True, 5)
    probes = [n for way, n in runs if way]
    assert probes and all(n == 5 for n in probes)
    holds = [n for way, n in runs[1:] if not way]
    # the first plain run is its probe and then its hold; then the holds double up to max_hold
    assert holds[0] == 5 + 16
    assert holds[1:4] == [32, 64, 64]
    assert not gate.speculating or gate.probing


def test_speculation_that_is_faster_holds_and_the_plain_way_is_probed_less_often():
    gate = SpecGate(probe_steps=4, first_hold=16, max_hold=64)
    steps = Steps(gate, seconds={True: 0.002, False: 0.001}, tokens={True: 4, False: 1})
    ways = steps.run(400)
    assert sum(ways) / len(ways) > 0.9
    plain_runs = [n for way, n in _runs(ways) if not way]
    assert plain_runs and all(n == 5 for n in plain_runs)  # only probes


def test_the_way_that_wins_its_probe_takes_over_and_its_hold_starts_again():
    gate = SpecGate(probe_steps=4, first_hold=16, max_hold=256)
    steps = Steps(gate, seconds={True: 0.005, False: 0.001}, tokens={True: 3, False: 1})
    steps.run(200)  # speculation loses: held off longer and longer
    assert gate.hold > 16
    steps.tokens[True] = 20  # the text turned repetitive: each verify keeps many more
    ways = steps.run(300)
    assert sum(ways[-100:]) > 90
    assert gate.held_way is True


def test_a_rate_measured_at_another_batch_size_is_measured_again():
    gate = SpecGate(probe_steps=4, first_hold=16, max_hold=1024)
    steps = Steps(gate, seconds={True: 0.005, False: 0.001}, tokens={True: 3, False: 1}, rows=32)
    steps.run(300)
    assert gate.hold >= 128 and not gate.speculating and not gate.probing
    held = gate.steps  # steps of the hold run so far
    # the batch halved: speculation is probed again once the hold has run first_hold steps, not at its end
    steps.rows = 16
    ways = steps.run(20)
    assert ways.index(True) == max(0, 15 - held) and held + 20 < gate.hold


def test_prompt_steps_and_idle_gaps_are_not_counted():
    gate = SpecGate(probe_steps=2, first_hold=4)
    gate.handled(0.0, None, 4, 4)
    assert gate.speculates(4)
    gate.handled(1.0, True, 4, 4)  # the probe's first step: not counted
    gate.handled(1.001, None, 4, 4)  # a prompt step: not counted, but the clock moves
    gate.handled(1.002, True, 4, 40)
    gate.handled(1.002 + 2 * MAX_STEP_S, True, 4, 4)  # after an idle gap: not counted
    assert gate.ways[True].rate is None and len(gate.ways[True].samples) == 1
    gate.handled(1.003 + 2 * MAX_STEP_S, True, 4, 40)
    # measured: the plain way's probe is next
    assert gate.ways[True].rate == pytest.approx(10 / 0.001) and not gate.speculating


def test_with_the_gate_on_the_outputs_are_those_without_speculation(qwen3_path, monkeypatch):
    """However the gate switches (here it is forced to alternate every few steps), outputs are the same:
    greedy and seeded sampled rows, both loops."""
    import itertools

    from cluster.scheduler import spec_gate

    flips = itertools.cycle([True] * 3 + [False] * 2)
    monkeypatch.setattr(spec_gate.SpecGate, "speculates", lambda self, rows: next(flips))
    texts = ["the the the and and of of to to in in is is it it " * 2, "one two three one two three one two"]
    params = [greedy(20, ignore_eos=True), SamplingParams(temperature=0.9, max_tokens=20, seed=3, ignore_eos=True)]
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_pause=0)
    for overlap in (True, False):
        with checked_llm(qwen3_path, page_size=4, overlap=overlap, **spec) as llm:
            prompts = encode_all(llm, texts)
            on = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.stats().spec_decode_num_draft_tokens > 0
        with checked_llm(qwen3_path, page_size=4, overlap=overlap) as llm:
            assert on == [o.token_ids for o in llm.generate(prompts, params)]


def test_a_draft_as_large_as_the_model_is_never_run_and_a_smaller_one_is_gated(qwen3_path, llama_path, caplog):
    """With the gate on, a draft reading as many weight bytes a forward as the model (here the model
    itself) cannot pay at any acceptance: speculation stays off, with a warning, and outputs are those
    without it. A smaller draft (a random llama, about 0.83 of the model's bytes) is measured by the gate."""
    texts = ["the the the and and of of to to in in is is it it " * 2]
    params = [greedy(16, ignore_eos=True)]
    same = dict(speculative_method="draft", speculative_model=str(qwen3_path))
    with checked_llm(qwen3_path, page_size=4, **same) as llm:
        spec = llm.scheduler.spec
        assert spec.draft.relative_cost == 1.0 and spec.never_pays
        prompts = encode_all(llm, texts)
        on = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats().spec_decode_num_draft_tokens == 0
    assert "speculation cannot pay" in caplog.text
    with checked_llm(qwen3_path, page_size=4) as llm:
        assert on == [o.token_ids for o in llm.generate(prompts, params)]
    smaller = dict(speculative_method="draft", speculative_model=str(llama_path))
    with checked_llm(qwen3_path, page_size=4, **smaller) as llm:
        spec = llm.scheduler.spec
        assert 0.5 < spec.draft.relative_cost < 1 and not spec.never_pays and spec.gate is not None
        llm.generate(prompts, params)
        assert llm.stats().spec_decode_num_draft_tokens > 0  # the gate's first probe speculates
