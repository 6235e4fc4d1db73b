"""Where a request's time to first token went, hop by hop: the router's hops measured on the router's
clock, the replica's on the replica's (carried back with the first token), and the channel's two
transfers as the router's round trip less the replica's share, so no interval ever spans two clocks.

Router (its time.perf_counter)                         Replica (its own clock)
  received ─ parse ─ parsed ─ tokenize ─ tokenized
  ─ submit ─ written to the channel ─┐                 read ─ queue ─ scheduled ─ prefill ─ prompt launched
                    transfer (both ways)               ─ first sample ─ first token on the host ─ flush ─ taken
  first delta read ◄─────────────────┘
  ─ detokenize ─ first token's piece (TTFT) ─ write ─ its SSE chunk written

parse + tokenize + submit + transfer + queue + prefill + first sample + flush + detokenize is the router's
TTFT."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.replicas.generation import Timing


@dataclass(frozen=True)
class RequestHops:
    """One request's hops to its first token, in seconds (exported as raylm:<name>_time_seconds); None
    where the request did not pass one (a body the router did not parse itself, the write of a request
    that is not streamed)."""

    router_parse: float | None  # the HTTP request received -> its body parsed and validated
    router_tokenize: float | None  # parsed -> its token ids ready (chat template, sampling checks)
    router_submit: float  # token ids -> written to the replica's channel (routing, the event-loop tick)
    request_transfer: float  # the channel both ways: the round trip less the replica's share
    request_queue: float  # read by the replica -> first prefill chunk scheduled
    request_prefill: float  # scheduled -> the launch of the prompt's last chunk returned on the replica's host
    request_first_sample: float  # that launch returned -> the first token on the host (device work, the next launch)
    request_first_flush: float  # first token on the host -> taken for sending to the router
    router_detokenize: float  # its message read by the router -> the first token's piece (TTFT)
    # the piece -> the stream's first chunk of output written to the client (a token whose text is held
    # back, part of a character or of a stop string, waits for the next)
    router_first_chunk_write: float | None

    def items(self) -> list[tuple[str, float]]:
        """(name, seconds) of each hop the request passed, in order."""
        return [(f.name, v) for f in fields(self) if (v := getattr(self, f.name)) is not None]


def request_hops(timing: Timing) -> RequestHops | None:
    """The hops of a request that got its first token from a replica that reported them; else None."""
    hops, first = timing.hops, timing.first_token
    if hops is None or hops.router_received is None or timing.submitted is None or first is None:
        return None
    start = timing.tokenized if timing.tokenized is not None else timing.arrival
    round_trip = max(0.0, hops.router_received - timing.submitted)
    # the replica's share lies inside the round trip, but the stamps around it are taken after the write
    # and after the read: a thread paused between its write and its clock (a busy host) or a drift of the
    # clocks' rates can leave the round trip shorter. Then the replica's hops are cut to fit it, the
    # latest first, so that every hop stays whole and they still sum to the TTFT
    queue, prefill, sample, flush = _fit((hops.queue_s, hops.prefill_s, hops.first_sample_s, hops.flush_s), round_trip)
    return RequestHops(
        router_parse=_between(timing.arrival, timing.parsed),
        router_tokenize=_between(timing.parsed, timing.tokenized),
        router_submit=max(0.0, timing.submitted - start),
        request_transfer=max(0.0, round_trip - (queue + prefill + sample + flush)),
        request_queue=queue,
        request_prefill=prefill,
        request_first_sample=sample,
        request_first_flush=flush,
        router_detokenize=max(0.0, first - hops.router_received),
        router_first_chunk_write=_between(first, timing.first_chunk_written),
    )


def _fit(spans: tuple[float, ...], total: float) -> tuple[float, ...]:
    """`spans` cut, the last first, so that their sum is at most `total`."""
    excess = sum(spans) - total
    cut = []
    for span in reversed(spans):
        taken = min(span, max(0.0, excess))
        excess -= taken
        cut.append(span - taken)
    return tuple(reversed(cut))


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)
