"""An engine says where its start went: each part's seconds, summing to the whole, in its log line."""

from __future__ import annotations

import logging

from cluster import LLM


def test_an_engine_records_and_logs_the_seconds_of_each_part_of_its_start(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        llm = LLM(str(llama_path), max_running_reqs=4)
    times = llm.engine.startup
    parts = [times.weights_s, times.kv_cache_s, times.graphs_s, times.warm_up_s]
    assert all(t >= 0 for t in parts) and times.weights_s > 0 and times.warm_up_s > 0
    assert abs(times.total_s - sum(parts)) < 1e-9
    assert times.as_dict()["total_s"] == times.total_s
    assert any(r.getMessage() == f"engine ready in {times}" for r in caplog.records)
    llm.shutdown()
