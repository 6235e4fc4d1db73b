"""Metrics after a known amount of traffic: the router's /metrics and Ray's Prometheus export must
both count exactly what was sent."""

from __future__ import annotations

import dataclasses
import re
import time

import httpx
import pytest
from fixtures import PROMPT_TEXTS
from helpers import serving

from cluster.messages import ReplicaStats, SchedulerStats

MAX_TOKENS = 7


@pytest.fixture(scope="module")
def observed(ray_cluster, qwen3_path):
    with serving(qwen3_path, served_model_name="observed", num_pages=1024, max_running_reqs=16) as srv:
        yield srv


def sample_value(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include the given ones."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}{{(.*)}} ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_router_and_ray_metrics_count_the_traffic_sent(observed, ray_metrics_port):
    prompts = PROMPT_TEXTS[:5]
    prompt_tokens = 0
    for i, prompt in enumerate(prompts):
        body = {"model": "observed", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "stream": i % 2 == 0}
        r = httpx.post(observed.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        prompt_tokens += len(observed.state.tokenizer(prompt).input_ids)
    generated = len(prompts) * MAX_TOKENS

    text = httpx.get(observed.url + "/metrics").text
    assert sample_value(text, "raylm:request_success_total", finish_reason="length") == len(prompts)
    assert sample_value(text, "raylm:generation_tokens_total") == generated
    assert sample_value(text, "raylm:prompt_tokens_total") == prompt_tokens
    assert sample_value(text, "raylm:time_to_first_token_seconds_count") == len(prompts)
    for family in ("raylm:inter_token_latency_seconds", "raylm:time_per_output_token_seconds",
                   "raylm:e2e_request_latency_seconds"):
        assert f"# TYPE {family} histogram" in text

    # the replica's own metrics, through Ray's metrics agent (it exports every few seconds)
    ray_cluster_stats = ray_stats(observed)
    assert ray_cluster_stats.live == 0
    tags = {"model": "observed", "replica": "0"}
    deadline = time.monotonic() + 60
    while True:
        exported = httpx.get(f"http://127.0.0.1:{ray_metrics_port}/metrics").text
        counts = (sample_value(exported, "ray_raylm_request_success_total", finish_reason="length", **tags),
                  sample_value(exported, "ray_raylm_generation_tokens_total", **tags),
                  sample_value(exported, "ray_raylm_prompt_tokens_total", **tags))
        if counts == (len(prompts), generated, prompt_tokens) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert counts == (len(prompts), generated, prompt_tokens)
    for family in ("ray_raylm_time_to_first_token_seconds", "ray_raylm_inter_token_latency_seconds",
                   "ray_raylm_time_per_output_token_seconds", "ray_raylm_e2e_request_latency_seconds",
                   "ray_raylm_queue_time_seconds"):
        assert sample_value(exported, family + "_count", **tags) == len(prompts), family
    for gauge in ("ray_raylm_num_running_reqs", "ray_raylm_num_queue_reqs", "ray_raylm_token_usage",
                  "ray_raylm_cache_hit_rate", "ray_raylm_gen_throughput"):
        assert gauge + "{" in exported, gauge


def ray_stats(srv) -> ReplicaStats:
    import ray
    return ray.get(srv.replicas[0].actor.stats.remote())  # also flushes the replica's counters


def test_preemptions_are_counted_once_each(ray_cluster):
    from types import SimpleNamespace

    from cluster.metrics import ReplicaMetrics
    metrics = ReplicaMetrics(0, "m", interval_s=0.0)
    counted: list[float] = []
    metrics.preemptions = SimpleNamespace(inc=lambda n, tags: counted.append(n))
    snap = SchedulerStats(running=1, waiting=0, live=1, request_slots_total=4, request_slots_free=3, pages_total=8,
                          pages_free=4, pages_cached=0, pages_reserved=0, prefix_hit_tokens=0, prompt_tokens_admitted=1,
                          steps=0, prefill_tokens=0, decode_tokens=0, preempted=0)
    for preempted in (0, 2, 2, 5):
        metrics.flush(lambda: dataclasses.replace(snap, preempted=preempted))
    assert counted == [2, 3]
