"""RAYLM_PROFILE_SCHEDULER: the replica's scheduler loop under cProfile, its statistics written when the
loop ends (cluster/replica/profiling.py); without it the loop runs unprofiled and writes nothing."""

from __future__ import annotations

import pstats

from cluster.replica.profiling import PROFILE_ENV, run_profiled


def _a_step_of_the_loop() -> int:
    return sum(range(1000))


def test_the_loop_is_profiled_into_a_file_named_by_the_replica(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "scheduler"))
    run_profiled(lambda: [_a_step_of_the_loop() for _ in range(3)], replica_id=2)
    stats = pstats.Stats(str(tmp_path / "scheduler-replica2.pstats")).stats
    calls = {name: v[1] for (_, _, name), v in stats.items()}
    assert calls["_a_step_of_the_loop"] == 3


def test_without_the_variable_the_loop_runs_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    ran = []
    run_profiled(lambda: ran.append(1), replica_id=0)
    assert ran == [1] and not list(tmp_path.iterdir())
