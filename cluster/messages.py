"""What crosses a replica's boundary, as records: the requests and aborts sent to a scheduler (and the
calls it runs between steps), the batch of deltas it sends back per step (one delta per request that
got a token) with its prefix cache's KV events, what a replica tells its callers once it has
started, and the counts it reports."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import ErrorKind, RaylmError
from cluster.sampling_params import SamplingParams


@dataclass
class AddRequest:
    """A request for a scheduler to run: its prompt's token ids and how to sample."""

    uid: int
    input_ids: list[int]
    params: SamplingParams
    # another choice of the same prompt (cluster/choices.py): this one is admitted once that request's
    # prompt is in the prefix cache (or it has ended), so the prompt is prefilled once
    after: int | None = None
    # when the replica read it (its own time.perf_counter; set there, never by the sender): where its
    # queue time starts
    received: float | None = None
    # the last output_len of input_ids are this request's output so far: it continues a stream begun on
    # another replica (router/replicas/migration.py), as a preempted request continues on its own
    # replica: its penalties, min_tokens, max_tokens and grammar count them as output
    output_len: int = 0


@dataclass
class AbortRequest:
    uid: int


@dataclass
class CallBetweenSteps:
    """A function for the scheduler's loop to run between two steps, where its state is consistent;
    its result (or exception) goes to `future`."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self.future.set_exception(e)


@dataclass
class FirstTokenHops:
    """Where a request's time to its first token went inside the replica, in seconds measured on the
    replica's own clock: intervals only, so a router on another host never subtracts across clocks."""

    queue_s: float  # read off the channel -> its first prefill chunk scheduled
    prefill_s: float  # scheduled -> the launch of its prompt's last chunk returned (every chunk before it whole)
    flush_s: float = 0.0  # first token on the host -> taken for sending to its router
    # that launch returned -> its first token on the host: the device's work the host waits for (under overlap
    # past FIRST_TOKEN_FIRST_MAX_LIVE, the next step's launch too); a launch-bound prompt shows in prefill_s
    first_sample_s: float = 0.0
    # the replica's clock when the token reached the host, until flush_s is measured; not sent
    sampled_at: float | None = field(default=None, repr=False, compare=False)
    # the router's clock when its message was read there; set by the router, never sent
    router_received: float | None = field(default=None, repr=False, compare=False)

    @property
    def replica_s(self) -> float:
        """The replica's whole share of the time to first token."""
        return self.queue_s + self.prefill_s + self.first_sample_s + self.flush_s

    def __reduce__(self):
        return FirstTokenHops, (self.queue_s, self.prefill_s, self.flush_s, self.first_sample_s)


@dataclass
class TokenDelta:
    uid: int
    token: int | None  # None when the request ended without a token (error, rejection)
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort or error
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    error_kind: ErrorKind | None = None
    # an invalid request's field at fault and OpenAI error code, as InvalidRequestError has them
    error_field: str | None = None
    error_code: str | None = None
    # with SamplingParams.prompt_logprobs, on a request's first token: for prompt positions 1.. (the first
    # has none), the prompt token's logprob and the k most likely (id, logprob) there
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cached_tokens: int | None = None  # on a request's first token: its prompt tokens served from the prefix cache
    hops: FirstTokenHops | None = None  # on a request's first token

    @classmethod
    def failure(cls, uid: int, kind: ErrorKind, why: str, at: str | None = None, code: str | None = None) -> TokenDelta:
        """The last delta of a request that failed (`at`: an invalid request's field at fault)."""
        return cls(
            uid, None, finished=True, finish_reason="error", error=why, error_kind=kind, error_field=at, error_code=code
        )

    @classmethod
    def failed_by(cls, uid: int, error: RaylmError) -> TokenDelta:
        """The last delta of a request that `error` failed, carrying what the exception says beyond its
        message (an invalid request's field and code), so the caller at the other end gets it whole."""
        return cls.failure(uid, error.kind, str(error), getattr(error, "field", None), getattr(error, "code", None))


@dataclass
class KVEvents:
    """Changes to the block hashes a replica's prefix cache holds (cluster/scheduler/prefix_cache/events.py) since
    its last message; with `full`, the whole set, to replace what the receiver knew."""

    page_size: int
    stored: list[int]
    removed: list[int]
    full: bool = False


class ReplicaOutput(list):
    """What one poll of a replica returns: its deltas (this is their list, in order) and, beside them,
    the KV events of the same steps (None when its cache did not change) and how many requests it
    holds (from every router: what one router sent is only its own share)."""

    def __init__(
        self, deltas: list[TokenDelta] = (), kv_events: KVEvents | None = None, live: int | None = None
    ) -> None:
        super().__init__(deltas)
        self.kv_events, self.live = kv_events, live

    def __reduce__(self):
        # a step's deltas cross a process boundary every step: pickled one object at a time they cost
        # the replica's interpreter per delta, each way (docs/BENCHMARKS.md), so they go as columns, with
        # the fields beyond (uid, token) only for the deltas that have them
        extra = [
            (i, rest)
            for i, d in enumerate(self)
            if (
                rest := (
                    d.finished,
                    d.finish_reason,
                    d.logprob,
                    d.top_logprobs,
                    d.error,
                    d.error_kind,
                    d.error_field,
                    d.error_code,
                    d.prompt_logprobs,
                    d.cached_tokens,
                    d.hops,
                )
            )
            != _PLAIN
        ]
        return _rebuild_output, ([d.uid for d in self], [d.token for d in self], extra, self.kv_events, self.live)


_PLAIN = (
    False,
    None,
    None,
    None,
    None,
    None,
    None,
    None,
    None,
    None,
    None,
)  # a TokenDelta's fields after (uid, token), as defaulted


def _rebuild_output(
    uids: list[int], tokens: list[int | None], extra: list[tuple], kv_events: KVEvents | None, live: int | None
) -> ReplicaOutput:
    out = ReplicaOutput([TokenDelta(u, t) for u, t in zip(uids, tokens)], kv_events, live)
    for i, (finished, reason, logprob, top, error, kind, at, code, prompt_logprobs, cached, hops) in extra:
        d = out[i]
        d.finished, d.finish_reason, d.logprob, d.top_logprobs = finished, reason, logprob, top
        d.error, d.error_kind, d.error_field, d.error_code = error, kind, at, code
        d.prompt_logprobs, d.cached_tokens, d.hops = prompt_logprobs, cached, hops
    return out


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica tells the router about its model and cache."""

    max_seq_len: int
    num_pages: int
    page_size: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    # where rank 0's engine start went, (part, seconds) in order (worker/startup.py's StartupTimes)
    startup: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    """A scheduler's state and counters at one moment, for an operator, the metrics or a test."""

    running: int  # requests decoding
    waiting: int  # requests waiting for (the rest of) their prefill
    live: int  # every request not ended
    request_slots_total: int
    request_slots_free: int  # including those whose release waits for the batch in flight
    pages_total: int
    pages_free: int
    pages_cached: int  # held by the prefix cache
    pages_reserved: int  # promised to admitted requests, not allocated yet
    prefix_hit_tokens: int  # prompt tokens found in the prefix cache
    prompt_tokens_admitted: int
    steps: int
    prefill_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int
    preempted: int  # preemptions so far (a request may be preempted more than once)
    mixed_steps: int = 0  # steps that decoded running requests beside prompt chunks
    queued_tokens: int = 0  # prompt tokens the waiting requests have yet to prefill
    oldest_wait_s: float = 0.0  # how long the request waiting longest has been here (its TTFT so far, at least)
    spec_decode_num_draft_tokens: int = 0  # tokens proposed to verify steps (speculative decoding)
    spec_decode_num_accepted_tokens: int = 0  # of them, accepted

    @property
    def kv_usage(self) -> float:
        """Pages held by live requests / all pages."""
        return (self.pages_total - self.pages_free - self.pages_cached) / self.pages_total

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(1, self.prompt_tokens_admitted)


@dataclass(frozen=True)
class ReplicaStats(SchedulerStats):
    """A replica's scheduler stats, with the replica's own."""

    replica: int = 0
    broken: str | None = None  # why the replica cannot serve any more; None while it serves
    rss_bytes: int = 0  # rank 0's resident memory
