"""The router's Prometheus metrics (GET /metrics), named as SGLang and vLLM name theirs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.model = model
        self.requests = Counter("raylm:request_success", "Finished requests by finish reason",
                                labels + ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("raylm:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("raylm:generation_tokens", "Generated tokens", labels,
                                         registry=self.registry)
        self.running = Gauge("raylm:num_requests_running", "Requests in flight through the router", labels,
                             registry=self.registry)
        self.ttft = Histogram("raylm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("raylm:inter_token_latency_seconds", "Mean time between output tokens per request",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("raylm:time_per_output_token_seconds", "Decode time per output token", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("raylm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def finished(self, reason: str, prompt_tokens: int, timing) -> None:
        m = self.model
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(timing.tokens)
        if timing.first_token is not None:
            self.ttft.labels(m).observe(timing.first_token - timing.arrival)
            self.e2e.labels(m).observe(timing.last_token - timing.arrival)
            if timing.tokens > 1:
                per_token = (timing.last_token - timing.first_token) / (timing.tokens - 1)
                self.itl.labels(m).observe(per_token)
                self.tpot.labels(m).observe(per_token)
