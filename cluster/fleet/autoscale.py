"""How many replicas the fleet wants, from the replicas' own load figures (their queues, their running
requests) over time: one more while requests (or their prompt tokens) keep waiting for their prefill
above a threshold per replica, or one waits past a TTFT target; one fewer while nothing waits and some
replica holds no request. Pure: no Ray, no clock of its own; the supervisor feeds it and applies its
answer (router/tier/autoscaler.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """One serving replica's figures, as its scheduler reports them (ReplicaStats)."""

    waiting: int  # requests waiting for (the rest of) their prefill
    running: int  # requests decoding
    queued_tokens: int = 0  # prompt tokens those waiting have yet to prefill
    oldest_wait_s: float = 0.0  # how long the one waiting longest has waited (a lower bound of its TTFT)

    @property
    def live(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True)
class AutoscaleSettings:
    min_replicas: int
    max_replicas: int
    queue_per_replica: int  # waiting requests per replica above which the fleet is short of replicas
    up_delay_s: float  # how long it must stay short before one is added
    down_delay_s: float  # how long it must stay idle before one is removed
    queued_tokens_per_replica: int | None = None  # queued prompt tokens per replica likewise; None: not used
    ttft_target_s: float | None = None  # a request waiting longer than this for its prefill; None: not used

    @classmethod
    def of(cls, config) -> AutoscaleSettings:
        """From a ServeConfig with a replica range."""
        low, high = config.replica_range
        return cls(
            low,
            high,
            config.autoscale_queue_per_replica,
            config.autoscale_up_delay_s,
            config.autoscale_down_delay_s,
            config.autoscale_queued_tokens_per_replica,
            config.autoscale_ttft_target_s,
        )


@dataclass(frozen=True)
class Decision:
    """The count wanted, and why, in words for the log (empty when it did not change)."""

    wanted: int
    why: str = ""


class AutoscalePolicy:
    """Remembers since when the fleet has been short of replicas (or idle); a change of the fleet's
    size starts both clocks again, so a new replica gets its delay to take load before the next
    decision."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.settings = settings
        self._short_since: float | None = None
        self._idle_since: float | None = None
        self._size: int | None = None

    def idle_for(self, now: float) -> float | None:
        """How long the fleet has been idle as the last decide saw it (nothing waiting, a replica without a
        request); None when it is not."""
        return None if self._idle_since is None else now - self._idle_since

    def decide(self, loads: list[ReplicaLoad], now: float, held: int = 0) -> Decision:
        """The replicas wanted serving, given the load of each replica serving (and routed to) at `now`.
        `held`: the fleet's replicas that serve no new request and stay (an operator drained them): they
        hold their GPUs, so the fleet is n + held, and max_replicas bounds that."""
        s, n = self.settings, len(loads)
        most = max(s.max_replicas - held, 0)
        if n != self._size:
            self._size, self._short_since, self._idle_since = n, None, None
        if n < min(s.min_replicas, most):
            return Decision(
                min(s.min_replicas, most), f"{n} replica(s) serve, fewer than min_replicas ({s.min_replicas})"
            )
        if n > most:
            beside = f" beside {held} drained" if held else ""
            return Decision(most, f"{n} replica(s) serve{beside}, more than max_replicas ({s.max_replicas})")
        waiting, tokens = sum(r.waiting for r in loads), sum(r.queued_tokens for r in loads)
        many_tokens = s.queued_tokens_per_replica is not None and tokens > s.queued_tokens_per_replica * n
        oldest = max((r.oldest_wait_s for r in loads), default=0.0)
        too_slow = s.ttft_target_s is not None and oldest > s.ttft_target_s
        short = waiting > s.queue_per_replica * n or many_tokens or too_slow
        idle = waiting == 0 and any(r.live == 0 for r in loads)
        self._short_since = (self._short_since if self._short_since is not None else now) if short else None
        self._idle_since = (self._idle_since if self._idle_since is not None else now) if idle else None
        if short and n < most and now - self._short_since >= s.up_delay_s:
            if waiting > s.queue_per_replica * n:
                above = f"{waiting} request(s) waiting, more than {s.queue_per_replica} per replica"
            elif many_tokens:
                above = f"{tokens} prompt token(s) queued, more than {s.queued_tokens_per_replica} per replica"
            else:
                above = (
                    f"a request waiting {oldest:.1f} s for its prefill, past the TTFT target of {s.ttft_target_s:g} s"
                )
            return Decision(n + 1, f"{above} on {n} replica(s) for {now - self._short_since:.1f} s")
        if idle and n > s.min_replicas and now - self._idle_since >= s.down_delay_s:
            empty = sum(1 for r in loads if r.live == 0)
            return Decision(
                n - 1,
                f"nothing waiting and {empty} of {n} replica(s) without a request for {now - self._idle_since:.1f} s",
            )
        return Decision(n)
