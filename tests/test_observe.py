"""Metrics after a known amount of traffic: the router's /metrics and Ray's Prometheus export must
both count exactly what was sent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fixtures import PROMPT_TEXTS
from helpers import serving
from prometheus_client import generate_latest

from cluster.messages import ReplicaStats, SchedulerStats
from router.replicas.generation import Timing

# the speculative-decoding counters of a replica's stats, for stand-ins of them
_NO_SPEC_DECODE = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0}

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
        body = {
            "model": "observed",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        r = httpx.post(observed.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        prompt_tokens += len(observed.state.tokenizer(prompt).input_ids)
    generated = len(prompts) * MAX_TOKENS

    text = httpx.get(observed.url + "/metrics").text
    assert sample_value(text, "raylm:request_success_total", finish_reason="length") == len(prompts)
    assert sample_value(text, "raylm:generation_tokens_total") == generated
    assert sample_value(text, "raylm:prompt_tokens_total") == prompt_tokens
    assert sample_value(text, "raylm:time_to_first_token_seconds_count") == len(prompts)
    # one inter-token sample per gap between two tokens, one TPOT sample per request
    assert sample_value(text, "raylm:inter_token_latency_seconds_count") == generated - len(prompts)
    assert sample_value(text, "raylm:time_per_output_token_seconds_count") == len(prompts)
    for family in (
        "raylm:inter_token_latency_seconds",
        "raylm:time_per_output_token_seconds",
        "raylm:e2e_request_latency_seconds",
    ):
        assert f"# TYPE {family} histogram" in text

    # the replica's own metrics, through Ray's metrics agent (it exports every few seconds)
    ray_cluster_stats = ray_stats(observed)
    assert ray_cluster_stats.live == 0
    tags = {"model": "observed", "replica": "0"}
    deadline = time.monotonic() + 60
    while True:
        exported = httpx.get(f"http://127.0.0.1:{ray_metrics_port}/metrics").text
        counts = (
            sample_value(exported, "ray_raylm_request_success_total", finish_reason="length", **tags),
            sample_value(exported, "ray_raylm_generation_tokens_total", **tags),
            sample_value(exported, "ray_raylm_prompt_tokens_total", **tags),
        )
        if counts == (len(prompts), generated, prompt_tokens) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert counts == (len(prompts), generated, prompt_tokens)
    assert sample_value(exported, "ray_raylm_queue_time_seconds_count", **tags) == len(prompts)
    # the replica's hops of each first token (router/http/hops.py), one sample per request
    for family in (
        "ray_raylm_request_prefill_time_seconds",
        "ray_raylm_request_first_sample_time_seconds",
        "ray_raylm_request_first_flush_time_seconds",
    ):
        assert sample_value(exported, family + "_count", **tags) == len(prompts), family
    # client-visible latencies are measured once, by the router
    for family in (
        "ray_raylm_time_to_first_token_seconds",
        "ray_raylm_inter_token_latency_seconds",
        "ray_raylm_time_per_output_token_seconds",
        "ray_raylm_e2e_request_latency_seconds",
    ):
        assert family + "_count" not in exported, family
    for gauge in (
        "ray_raylm_num_running_reqs",
        "ray_raylm_num_queue_reqs",
        "ray_raylm_token_usage",
        "ray_raylm_cache_hit_rate",
        "ray_raylm_gen_throughput",
    ):
        assert gauge + "{" in exported, gauge


def test_inter_token_latency_is_one_sample_per_gap_and_tokens_that_arrive_together_have_none():
    from router.http.metrics import RouterMetrics

    timing = Timing(arrival=10.0)
    timing.received(1, 10.5)  # the first token
    timing.received(1, 10.6)
    timing.received(3, 11.0)  # three steps' tokens in one message
    assert timing.tokens == 5 and timing.gaps == pytest.approx([0.1, 0.4, 0.0, 0.0])
    metrics = RouterMetrics("m")
    metrics.finished("length", 3, timing)
    registry = metrics.registry
    assert registry.get_sample_value("raylm:inter_token_latency_seconds_count", {"model": "m"}) == 4
    assert registry.get_sample_value("raylm:inter_token_latency_seconds_sum", {"model": "m"}) == pytest.approx(0.5)
    assert registry.get_sample_value("raylm:time_per_output_token_seconds_sum", {"model": "m"}) == pytest.approx(0.125)
    assert registry.get_sample_value("raylm:time_to_first_token_seconds_sum", {"model": "m"}) == pytest.approx(0.5)
    assert registry.get_sample_value("raylm:e2e_request_latency_seconds_sum", {"model": "m"}) == pytest.approx(1.0)


def ray_stats(srv) -> ReplicaStats:
    import ray

    return ray.get(srv.replicas[0].actor.stats.remote())  # also flushes the replica's counters


def test_preemptions_are_counted_once_each(ray_cluster):
    from types import SimpleNamespace

    from cluster.replica.metrics import ReplicaMetrics

    metrics = ReplicaMetrics(0, "m", interval_s=0.0)
    counted: list[float] = []
    metrics.preemptions = SimpleNamespace(inc=lambda n, tags: counted.append(n))
    snap = SchedulerStats(
        running=1,
        waiting=0,
        live=1,
        request_slots_total=4,
        request_slots_free=3,
        pages_total=8,
        pages_free=4,
        pages_cached=0,
        pages_reserved=0,
        prefix_hit_tokens=0,
        prompt_tokens_admitted=1,
        steps=0,
        prefill_tokens=0,
        decode_tokens=0,
        preempted=0,
    )
    for preempted in (0, 2, 2, 5):
        metrics.flush(lambda: dataclasses.replace(snap, preempted=preempted))
    assert counted == [2, 3]


class _StatsActor:
    """Answers stats() with the given record, or never (a stuck replica)."""

    def __init__(self, stats=None) -> None:
        self.calls, self._stats = 0, stats
        self.stats = SimpleNamespace(remote=self._remote)

    def _remote(self):
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        if self._stats is not None:
            future.set_result(self._stats)
        return future


class _Client:
    healthy = True

    def __init__(self, replica_id: int, actor: _StatsActor) -> None:
        self.replica_id, self.actor = replica_id, actor


def test_a_replica_that_does_not_answer_is_left_out_of_the_scrape_without_holding_it_up():
    from router.http.metrics import RouterMetrics

    stats = SimpleNamespace(running=2, waiting=1, kv_usage=0.25, prefix_hit_rate=0.5, preempted=3, **_NO_SPEC_DECODE)
    answering, stuck = _Client(0, _StatsActor(stats)), _Client(1, _StatsActor())
    metrics = RouterMetrics("m")
    metrics.replica_gauges.timeout_s = 0.2

    async def scrape_twice() -> list[str]:
        texts = []
        for _ in range(2):
            await metrics.replica_gauges.refresh([answering, stuck])
            texts.append(generate_latest(metrics.registry).decode())
        return texts

    start = time.monotonic()
    texts = asyncio.run(scrape_twice())
    assert time.monotonic() - start < 2
    for text in texts:
        assert sample_value(text, "raylm:num_running_reqs", replica="0") == 2
        assert sample_value(text, "raylm:token_usage", replica="0") == 0.25
        assert sample_value(text, "raylm:num_preemptions_total", replica="0") == 3
        assert 'replica="1"' not in text
    assert stuck.actor.calls == 1  # its call still running is awaited again, not repeated


def test_router_metrics_show_each_replicas_gauges_by_replica(ray_cluster, qwen3_path):
    prompt = PROMPT_TEXTS[-1]  # many pages: the second request finds them in the prefix cache
    with serving(qwen3_path, served_model_name="observed2", replicas=2, num_pages=512) as srv:
        for _ in range(2):
            body = {"model": "observed2", "prompt": prompt, "max_tokens": 2}
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        streaming, stop = threading.Event(), threading.Event()

        def long_stream() -> None:
            body = {
                "model": "observed2",
                "prompt": "Once upon a time",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _line in r.iter_lines():
                    streaming.set()
                    if stop.is_set():
                        return  # the router aborts the request when the client goes

        client = threading.Thread(target=long_stream)
        client.start()
        try:
            assert streaming.wait(30)
            text = httpx.get(srv.url + "/metrics", timeout=10).text
        finally:
            stop.set()
            client.join(60)
    for gauge in (
        "raylm:num_running_reqs",
        "raylm:num_queue_reqs",
        "raylm:token_usage",
        "raylm:cache_hit_rate",
        "raylm:num_preemptions_total",
    ):
        for replica in ("0", "1"):
            assert f'{gauge}{{model="observed2",replica="{replica}"}}' in text, (gauge, replica)
    assert sample_value(text, "raylm:num_running_reqs") == 1
    assert 0 < sample_value(text, "raylm:token_usage") < 1
    assert sample_value(text, "raylm:cache_hit_rate") > 0


def test_the_grafana_dashboard_queries_only_metrics_that_are_exported():
    from ray.util.metrics import Counter, Histogram

    from cluster.replica.metrics import ReplicaMetrics
    from router.http.metrics import RouterMetrics

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "configs" / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried = {name for q in queries for name in re.findall(r"\b(?:ray_)?raylm[:_][a-z0-9_:]+", q)}

    router = RouterMetrics("m")  # with a sample of every series, so each is in the text
    router.running.labels("m").inc()
    timing = Timing(arrival=0.0)
    timing.received(1, 0.1)
    timing.received(1, 0.2)
    router.finished("stop", 3, timing)
    router.fleet.set(2, 1)
    router.replica_gauges._stats = {
        0: SimpleNamespace(running=1, waiting=0, kv_usage=0.1, prefix_hit_rate=0.0, preempted=0, **_NO_SPEC_DECODE)
    }
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in generate_latest(router.registry).decode().splitlines()
        if line and not line.startswith("#")
    }
    suffixes = {Counter: ("_total",), Histogram: ("_bucket", "_count", "_sum")}
    for metric in vars(ReplicaMetrics(0, "m")).values():  # Ray prefixes the names it exports with ray_
        if hasattr(metric, "info"):
            exported |= {f"ray_{metric.info['name']}{s}" for s in suffixes.get(type(metric), ("",))}
    assert queried and queried <= exported, sorted(queried - exported)
    assert {"datasource", "model"} <= {v["name"] for v in dashboard["templating"]["list"]}
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
