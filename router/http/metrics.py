"""The router's Prometheus metrics (GET /metrics), named as SGLang and vLLM name theirs: what the
router measures of each request, and each replica's own gauges, read from the replicas on scrape, so
one scrape of one process shows KV usage, queues and cache hit rate."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.http.hops import request_hops

if TYPE_CHECKING:
    from cluster import ReplicaStats
    from router.replicas.generation import Timing

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# gaps between tokens: 0 for tokens that arrived together, a few ms per decode step on a GPU
# the hops of a first token (router/http/hops.py): tens of microseconds to a long queue's minutes
_HOP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_HOP_HELP = {
    "router_parse": "Router: the HTTP request received to its body parsed and validated",
    "router_tokenize": "Router: the body parsed to its token ids ready (chat template, sampling checks)",
    "router_submit": "Router: token ids ready to the request written to its replica's channel (routing included)",
    "request_transfer": "The channel both ways: the router's round trip to the first token less the replica's share",
    "request_queue": "Replica: the request read off its channel to its first prefill chunk scheduled",
    "request_prefill": "Replica: the first prefill chunk scheduled to the launch of the prompt's last chunk returned",
    "request_first_sample": "Replica: the prompt's last launch returned to its first token on the host",
    "request_first_flush": "Replica: the first token on the host to its message taken for sending to the router",
    "router_detokenize": "Router: the first token's message read to its text piece ready (the TTFT stamp)",
    # a first token whose text is held back (part of a character, a stop string's start) waits for the next
    "router_first_chunk_write": "Router: the first token's piece to the stream's first chunk of output written",
}
_ITL_BUCKETS = (0.0, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class RouterMetrics:
    """With PROMETHEUS_MULTIPROC_DIR set (the router actors of one tier share one such folder on their
    node), every router's counters and histograms are kept in that folder too, and a scrape of any of
    them (`exposition`) shows the tier's sums: a scrape of the shared port reaches one router at random."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        labels = ["model"]
        self.model = model
        self.requests = Counter(
            "raylm:request_success",
            "Requests that ran to their end (stop, length), by finish reason",
            labels + ["finish_reason"],
            registry=self.registry,
        )
        self.failures = Counter(
            "raylm:request_failure",
            "Requests that did not (rejected, timeout, abort, error), by reason",
            labels + ["reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "raylm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=self.registry
        )
        self.generation_tokens = Counter("raylm:generation_tokens", "Generated tokens", labels, registry=self.registry)
        self.running = Gauge(
            "raylm:num_requests_running",
            "Requests in flight through the router",
            labels,
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.ttft = Histogram(
            "raylm:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "raylm:inter_token_latency_seconds",
            "Time between two consecutive output tokens of a request, one sample per gap",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "raylm:time_per_output_token_seconds",
            "A request's decode time per output token after the first (one sample per request)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "raylm:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # one histogram per hop of the way to a request's first token, named as vLLM's request_*_time_seconds
        self.hops = {
            name: Histogram(f"raylm:{name}_time_seconds", help_, labels, buckets=_HOP_BUCKETS, registry=self.registry)
            for name, help_ in _HOP_HELP.items()
        }
        self.migrations = Counter(
            "raylm:request_migrations",
            "Choices continued on another replica, by cause (replica_down: theirs died or broke; "
            "drained: theirs was drained; rebalanced: waiting there, moved to a replica that joined)",
            labels + ["cause"],
            registry=self.registry,
        )
        self.replica_gauges = ReplicaGauges(model)
        self.registry.register(self.replica_gauges)
        self.fleet = FleetGauges(model)
        self.registry.register(self.fleet)

    def exposition(self) -> bytes:
        """The Prometheus text of a scrape: this router's metrics, or the tier's with a shared folder,
        then the replicas' gauges as last refreshed."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.shared_dir)
        registry.register(self.replica_gauges)
        registry.register(self.fleet)
        return generate_latest(registry)

    def finished(self, reason: str, prompt_tokens: int, timing: Timing) -> None:
        m = self.model
        self.ended(reason)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(timing.tokens)
        if timing.first_token is not None:
            self.ttft.labels(m).observe(timing.first_token - timing.arrival)
            self.e2e.labels(m).observe(timing.last_token - timing.arrival)
            itl = self.itl.labels(m)
            for gap in timing.gaps:
                itl.observe(gap)
            if (tpot := timing.time_per_output_token) is not None:
                self.tpot.labels(m).observe(tpot)
            if (hops := request_hops(timing)) is not None:
                for name, seconds in hops.items():
                    self.hops[name].labels(m).observe(seconds)

    def ended(self, reason: str) -> None:
        """Counts a request's end: a success when it stopped or reached its length, else a failure."""
        if reason in SUCCESSES:
            self.requests.labels(self.model, reason).inc()
        else:
            self.failures.labels(self.model, reason).inc()


# the finish reasons of a request that ran to its end; a refusal, a timeout, an abort or an error did not
SUCCESSES = frozenset({"stop", "length"})


class ReplicaGauges(Collector):
    """Each replica's running and waiting requests, KV usage, prefix hit rate, preemptions and speculative
    decoding's proposed and accepted tokens, labelled by replica: the names its scheduler reports
    through Ray (cluster/replica/metrics.py), as read at the last refresh(). A replica that does not
    answer in time is left out of that scrape rather than holding it up (Prometheus then shows a gap,
    not a stale value)."""

    def __init__(self, model: str, timeout_s: float = 2.0) -> None:
        self.model, self.timeout_s = model, timeout_s
        self._stats: dict[int, ReplicaStats] = {}
        self._pending: dict[object, asyncio.Future] = {}  # client -> its stats call still running

    async def refresh(self, clients: Sequence) -> None:
        """Reads every serving replica's stats at once, waiting at most timeout_s."""
        serving = [c for c in clients if c.healthy]
        # a call that outlived its scrape is awaited again, not repeated: calls piling up on a stuck
        # replica would take the actor's threads from its submits and polls
        calls = {c: self._pending.pop(c, None) or asyncio.ensure_future(c.actor.stats.remote()) for c in serving}
        for gone in self._pending.values():  # its replica left routing: nobody reads the answer
            gone.cancel()
        self._pending = dict(calls)  # a copy: a scrape at the same time takes from it, not from ours
        done, _ = await asyncio.wait(calls.values(), timeout=self.timeout_s) if calls else (set(), set())
        stats = {}
        for client, call in list(calls.items()):
            if call in done:
                self._pending.pop(client, None)  # a scrape at the same time may have taken it already
                # a failed call: the health checks deal with its replica
                if not call.cancelled() and call.exception() is None:
                    stats[client.replica_id] = call.result()
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families())

    def _families(self) -> list[Metric]:
        labels = ["model", "replica"]
        running = GaugeMetricFamily("raylm:num_running_reqs", "Requests decoding, per replica", labels=labels)
        queued = GaugeMetricFamily("raylm:num_queue_reqs", "Requests waiting for prefill, per replica", labels=labels)
        usage = GaugeMetricFamily(
            "raylm:token_usage", "KV-cache pages held by requests / all pages, per replica", labels=labels
        )
        hit_rate = GaugeMetricFamily(
            "raylm:cache_hit_rate", "Prompt tokens found in the prefix cache / admitted, per replica", labels=labels
        )
        preemptions = CounterMetricFamily(
            "raylm:num_preemptions", "Requests preempted for KV pages (recomputed later), per replica", labels=labels
        )
        drafted = CounterMetricFamily(
            "raylm:spec_decode_num_draft_tokens",
            "Tokens proposed to verify steps (speculative decoding), per replica",
            labels=labels,
        )
        accepted = CounterMetricFamily(
            "raylm:spec_decode_num_accepted_tokens",
            "Proposed tokens the verify steps accepted, per replica",
            labels=labels,
        )
        for replica, s in sorted(self._stats.items()):
            values = [self.model, str(replica)]
            running.add_metric(values, s.running)
            queued.add_metric(values, s.waiting)
            usage.add_metric(values, s.kv_usage)
            hit_rate.add_metric(values, s.prefix_hit_rate)
            preemptions.add_metric(values, s.preempted)
            drafted.add_metric(values, s.spec_decode_num_draft_tokens)
            accepted.add_metric(values, s.spec_decode_num_accepted_tokens)
        return [running, queued, usage, hit_rate, preemptions, drafted, accepted]


class FleetGauges(Collector):
    """The replicas the autoscaler wants and those serving, as the launching process last told this
    router (router/tier/autoscaler.py); nothing without autoscaling."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.size: tuple[int, int] | None = None  # (wanted, running)

    def set(self, wanted: int, running: int) -> None:
        self.size = (wanted, running)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families())

    def _families(self) -> list[Metric]:
        if self.size is None:
            return []
        wanted = GaugeMetricFamily("raylm:replicas_wanted", "Replicas the autoscaler wants", labels=["model"])
        running = GaugeMetricFamily("raylm:replicas_running", "Replicas serving (routed to)", labels=["model"])
        wanted.add_metric([self.model], self.size[0])
        running.add_metric([self.model], self.size[1])
        return [wanted, running]
