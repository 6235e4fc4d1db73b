"""An n-choice request as the scheduler runs it: n requests, one per choice, each with its own uid and
seed (SamplingParams.for_choice); the later choices wait for the first one's prompt to reach the prefix
cache, so that the prompt is prefilled once and its pages are shared."""

from __future__ import annotations

from collections.abc import Iterator

from cluster.messages import AddRequest
from cluster.sampling_params import SamplingParams


def fan_out(uids: Iterator[int], input_ids: list[int], params: SamplingParams) -> list[AddRequest]:
    """One AddRequest per choice, in choice order; uids are drawn from `uids`."""
    first = next(uids)
    requests = [AddRequest(first, input_ids, params.for_choice(0))]
    requests += [AddRequest(next(uids), input_ids, params.for_choice(i), after=first) for i in range(1, params.n)]
    return requests
