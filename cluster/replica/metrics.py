"""A replica's metrics through ray.util.metrics (shown by the Ray dashboard, exported to Prometheus
by every node's metrics agent), tagged with replica and model. Only rank 0 (the scheduler) reports."""

from __future__ import annotations

import time
from collections.abc import Callable

from ray.util.metrics import Counter, Gauge, Histogram

from cluster.messages import FirstTokenHops, SchedulerStats, TokenDelta
from cluster.scheduler.req import Req

_LATENCY = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
# the hops of a first token: tens of microseconds to a prefill's seconds
_HOP = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_TAGS = ("replica", "model")


class ReplicaMetrics:
    def __init__(self, replica_id: int, model: str, interval_s: float = 1.0) -> None:
        self.tags = {"replica": str(replica_id), "model": model}
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._tokens_since = 0
        self._preempted = 0
        self._drafted = self._accepted = 0
        self.running = Gauge("raylm_num_running_reqs", "Requests decoding", _TAGS)
        self.queued = Gauge("raylm_num_queue_reqs", "Requests waiting for prefill", _TAGS)
        self.token_usage = Gauge("raylm_token_usage", "KV-cache pages in use / all pages", _TAGS)
        self.cache_hit_rate = Gauge("raylm_cache_hit_rate", "Prompt tokens found in the prefix cache / admitted", _TAGS)
        self.gen_throughput = Gauge("raylm_gen_throughput", "Generated tokens per second", _TAGS)
        self.prompt_tokens = Counter("raylm_prompt_tokens", "Prompt tokens of admitted requests", _TAGS)
        self.generation_tokens = Counter("raylm_generation_tokens", "Generated tokens", _TAGS)
        self.preemptions = Counter("raylm_num_preemptions", "Requests preempted for KV pages (recomputed later)", _TAGS)
        self.spec_draft_tokens = Counter(
            "raylm_spec_decode_num_draft_tokens", "Tokens proposed to verify steps (speculative decoding)", _TAGS
        )
        self.spec_accepted_tokens = Counter(
            "raylm_spec_decode_num_accepted_tokens", "Proposed tokens the verify steps accepted", _TAGS
        )
        self.requests = Counter(
            "raylm_request_success", "Requests that ran to their end (stop, length)", _TAGS + ("finish_reason",)
        )
        self.failures = Counter("raylm_request_failure", "Requests aborted or failed, by reason", _TAGS + ("reason",))
        # client-visible latencies (TTFT, inter-token, per output token, end to end) are measured once,
        # where the client's tokens arrive: by the router (router/http/metrics.py)
        self.queue_time = Histogram("raylm_queue_time_seconds", "Arrival to first prefill", _LATENCY, _TAGS)
        # the replica's hops of each first token (the router shows them beside its own: router/http/metrics.py)
        self.prefill_time = Histogram(
            "raylm_request_prefill_time_seconds",
            "First prefill chunk scheduled to the launch of the prompt's last chunk returned",
            _HOP,
            _TAGS,
        )
        self.first_sample_time = Histogram(
            "raylm_request_first_sample_time_seconds",
            "The prompt's last launch returned to its first token on the host",
            _HOP,
            _TAGS,
        )
        self.first_flush_time = Histogram(
            "raylm_request_first_flush_time_seconds",
            "First token on the host to its message taken for sending to the router",
            _HOP,
            _TAGS,
        )

    def on_output(self, deltas: list[TokenDelta]) -> None:
        self._tokens_since += sum(1 for d in deltas if d.token is not None)

    def on_finish(self, req: Req, reason: str) -> None:
        tags = self.tags
        if reason in ("stop", "length"):
            self.requests.inc(1, {**tags, "finish_reason": reason})
        else:
            self.failures.inc(1, {**tags, "reason": reason})
        if req.prompt_len:
            self.prompt_tokens.inc(req.prompt_len, tags)
        if req.scheduled is not None:
            self.queue_time.observe(req.scheduled - req.arrival, tags)

    def on_first_token(self, hops: FirstTokenHops) -> None:
        self.prefill_time.observe(hops.prefill_s, self.tags)
        self.first_sample_time.observe(hops.first_sample_s, self.tags)
        self.first_flush_time.observe(hops.flush_s, self.tags)

    def on_replica_failed(self, num_requests: int) -> None:
        """The replica broke with num_requests live: each ended with an error, and nothing runs any more
        (its scheduler may be stuck, so its state is not read)."""
        tags = self.tags
        if num_requests:
            self.failures.inc(num_requests, {**tags, "reason": "error"})
        self.running.set(0, tags)
        self.queued.set(0, tags)

    def on_step(self, snapshot_fn: Callable[[], SchedulerStats]) -> None:
        """Gauges and token counters, at most once per interval (the scheduler's state is read then)."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        s = snapshot_fn()
        tags = self.tags
        self.running.set(s.running, tags)
        self.queued.set(s.waiting, tags)
        self.token_usage.set(s.kv_usage, tags)
        self.cache_hit_rate.set(s.prefix_hit_rate, tags)
        self.gen_throughput.set(self._tokens_since / (now - self._last), tags)
        if self._tokens_since:
            self.generation_tokens.inc(self._tokens_since, tags)
        if s.preempted > self._preempted:
            self.preemptions.inc(s.preempted - self._preempted, tags)
            self._preempted = s.preempted
        if s.spec_decode_num_draft_tokens > self._drafted:
            self.spec_draft_tokens.inc(s.spec_decode_num_draft_tokens - self._drafted, tags)
            self._drafted = s.spec_decode_num_draft_tokens
        if s.spec_decode_num_accepted_tokens > self._accepted:
            self.spec_accepted_tokens.inc(s.spec_decode_num_accepted_tokens - self._accepted, tags)
            self._accepted = s.spec_decode_num_accepted_tokens
        self._tokens_since = 0
        self._last = now

    def flush(self, snapshot_fn: Callable[[], SchedulerStats]) -> None:
        self._last = 0.0
        self.on_step(snapshot_fn)
