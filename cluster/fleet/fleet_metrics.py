"""The fleet's size through ray.util.metrics (the Ray dashboard's metrics view, and Prometheus by
every node's metrics agent): the replicas the autoscaler wants and those serving, tagged by model."""

from __future__ import annotations

from ray.util.metrics import Gauge

_TAGS = ("model",)


class FleetMetrics:
    def __init__(self, model: str) -> None:
        self.tags = {"model": model}
        self.wanted = Gauge("raylm_replicas_wanted", "Replicas the autoscaler wants", _TAGS)
        self.running = Gauge("raylm_replicas_running", "Replicas serving (routed to)", _TAGS)

    def set(self, wanted: int, running: int) -> None:
        self.wanted.set(wanted, self.tags)
        self.running.set(running, self.tags)
