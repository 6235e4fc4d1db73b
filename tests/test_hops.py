"""The hops of each request's way to its first token (router/http/hops.py): exported once per request
served, each non-negative, summing to the router's TTFT, and never an interval across two clocks."""

from __future__ import annotations

import asyncio
import pickle
import statistics
import sys
import threading
import time

import httpx
import pytest
from fixtures import PROMPT_TEXTS
from helpers import client, serving
from test_observe import sample_value

from cluster import FirstTokenHops, ReplicaOutput, TokenDelta
from router.http.hops import request_hops
from router.replicas.generation import Timing

TO_FIRST_TOKEN = (
    "router_parse",
    "router_tokenize",
    "router_submit",
    "request_transfer",
    "request_queue",
    "request_prefill",
    "request_first_sample",
    "request_first_flush",
    "router_detokenize",
)


@pytest.fixture(scope="module")
def hopped(ray_cluster, qwen3_path):
    with serving(qwen3_path, served_model_name="hopped", num_pages=512, max_running_reqs=8) as srv:
        yield srv


def test_every_hop_is_exported_once_per_request_and_they_sum_to_its_ttft(hopped):
    seen = []  # every finished request's Timing, as the router's metrics receive it
    finished = hopped.state.metrics.finished

    def recording(reason, prompt_tokens, timing):
        seen.append(timing)
        finished(reason, prompt_tokens, timing)

    hopped.state.metrics.finished = recording
    try:
        openai = client(hopped)
        streams = 0
        for i, prompt in enumerate(PROMPT_TEXTS[:4]):
            stream = i % 2 == 0
            r = openai.completions.create(
                model="hopped", prompt=prompt, max_tokens=5, stream=stream, extra_body={"ignore_eos": True}
            )
            if stream:
                assert [c for c in r]
                streams += 1
        for stream in (True, False):
            r = openai.chat.completions.create(
                model="hopped",
                messages=[{"role": "user", "content": PROMPT_TEXTS[5]}],
                max_tokens=5,
                stream=stream,
                extra_body={"ignore_eos": True},
            )
            if stream:
                assert [c for c in r]
                streams += 1
    finally:
        hopped.state.metrics.finished = finished
    served = len(seen)
    assert served == 6

    text = httpx.get(hopped.url + "/metrics").text
    for name in TO_FIRST_TOKEN:
        assert sample_value(text, f"raylm:{name}_time_seconds_count") == served, name
    assert sample_value(text, "raylm:router_first_chunk_write_time_seconds_count") == streams
    assert sample_value(text, "raylm:time_to_first_token_seconds_count") == served

    for timing in seen:
        hops = request_hops(timing)
        values = dict(hops.items())
        assert all(v >= 0 for v in values.values()), values
        ttft = timing.first_token - timing.arrival
        # the router's own hops and the round trip are on its clock; with the replica's share they are the TTFT
        assert sum(values[h] for h in TO_FIRST_TOKEN) == pytest.approx(ttft, abs=1e-9)
        router_side = ("router_parse", "router_tokenize", "router_submit", "router_detokenize")
        assert sum(values[h] for h in router_side) <= ttft
        replica = hops.request_queue + hops.request_prefill + hops.request_first_sample + hops.request_first_flush
        assert replica <= ttft


def test_the_replicas_hops_cross_as_intervals_whatever_its_clock():
    # the replica's clock is a day ahead of the router's: only intervals measured on it may cross
    replica_clock = 86_400.0
    hops = FirstTokenHops(0.001, 0.003, first_sample_s=0.001, sampled_at=replica_clock)
    hops.flush_s, hops.sampled_at = 0.0005, None
    out = pickle.loads(pickle.dumps(ReplicaOutput([TokenDelta(7, 3, hops=hops)])))
    got = out[0].hops
    assert (got.queue_s, got.prefill_s, got.first_sample_s, got.flush_s, got.sampled_at) == (
        0.001,
        0.003,
        0.001,
        0.0005,
        None,
    )

    timing = Timing(arrival=10.0, parsed=10.001, tokenized=10.002, submitted=10.003)
    got.router_received = 10.010  # a round trip of 7 ms, 5.5 of them the replica's
    timing.hops = got
    timing.received(1, 10.011)
    hops = request_hops(timing)
    assert hops.request_transfer == pytest.approx(0.0015)
    assert (hops.request_prefill, hops.request_first_sample) == pytest.approx((0.003, 0.001))
    assert hops.router_detokenize == pytest.approx(0.001)
    assert sum(v for name, v in hops.items()) == pytest.approx(0.011)


def test_a_replica_share_longer_than_the_round_trip_is_cut_to_it_the_latest_hops_first():
    # the stamps around the round trip are taken after the write and the read: a paused thread can leave
    # the round trip (here 3 ms) shorter than the replica's intervals (5.5 ms); every hop stays whole and
    # they still sum to the TTFT
    timing = Timing(arrival=10.0, parsed=10.001, tokenized=10.002, submitted=10.003)
    timing.hops = FirstTokenHops(0.001, 0.004, 0.0005)
    timing.hops.router_received = 10.006
    timing.received(1, 10.007)
    hops = request_hops(timing)
    assert all(v >= 0 for _, v in hops.items())
    assert (hops.request_transfer, hops.request_first_flush) == (0.0, 0.0)
    assert hops.request_queue == pytest.approx(0.001) and hops.request_prefill == pytest.approx(0.002)
    assert sum(v for _, v in hops.items()) == pytest.approx(0.007)


def test_a_request_without_the_replicas_hops_has_none():
    timing = Timing(arrival=1.0, submitted=1.001)
    timing.received(1, 1.01)
    assert request_hops(timing) is None


class _Channel:
    """A replica channel that records each write (one write: one message)."""

    def __init__(self) -> None:
        self.writes: list[tuple[list[int], list[int]]] = []

    def send(self, submits, aborts) -> None:
        self.writes.append(([r.uid for r in submits], list(aborts)))


def test_a_submit_is_written_at_once_and_the_rest_of_its_tick_in_one_message():
    from helpers import greedy

    from router.replicas.client import ReplicaClient

    async def run():
        c = ReplicaClient(0, actor=None, kv_events=False)
        c.channel, c._connecting = _Channel(), False
        sent_at = []
        c.submit(1, [5, 6], greedy(2), on_sent=sent_at.append)
        # written before the handler that submitted it goes on (its response's start, its first read)
        assert c.channel.writes == [([1], [])] and len(sent_at) == 1
        c.submit(2, [5], greedy(2))
        c.submit(3, [5], greedy(2))
        c.abort(1)
        assert len(c.channel.writes) == 1  # the rest of the tick waits for its end
        await asyncio.sleep(0)
        assert c.channel.writes == [([1], []), ([2, 3], [1])]
        c.submit(4, [5], greedy(2))  # a new tick: at once again
        assert c.channel.writes[-1] == ([4], [])

    asyncio.run(run())


def test_a_first_token_is_taken_for_sending_while_the_scheduler_thread_runs_python():
    from cluster.config import ReplicaConfig
    from cluster.replica.actor import SchedulerActor

    default = sys.getswitchinterval()  # CPython's 5 ms: the wait this replica setting removes
    try:
        SchedulerActor(ReplicaConfig())  # a replica's process sets its interval as it starts
        flushes = _first_token_flushes(one_at_a_time=False)
    finally:
        sys.setswitchinterval(default)
    assert statistics.median(flushes) < default, flushes


def test_a_first_token_is_handed_to_its_waiting_sender_before_the_scheduler_thread_runs_on():
    """publish waits (briefly) for a waiting sender to take a first token: the interpreter goes to the
    sender then and there, not when the scheduler thread's Python next lets go of it (at CPython's default
    switch interval, 5 ms on)."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default (a replica built in this process earlier sets 0.5 ms)
    try:
        flushes = _first_token_flushes(one_at_a_time=True)
    finally:
        sys.setswitchinterval(default)
    assert statistics.median(flushes) < 0.001, flushes


def _first_token_flushes(one_at_a_time: bool, rounds: int = 20) -> list[float]:
    """Each of `rounds` first tokens published while a sender thread polls (the channel's, cluster/channel.py),
    the scheduler thread running Python on after each; their flush_s as the sender measured them.
    one_at_a_time: each published once the sender waits in its poll again, and ended once taken (low load)."""
    from cluster.replica.subscribers import Subscribers

    subs, flushes = Subscribers(), []
    done, taken = threading.Event(), threading.Semaphore(0)

    def sender() -> None:
        while not done.is_set():
            for d in subs.poll(0.1):
                flushes.append(d.hops.flush_s)
                taken.release()

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        for uid in range(rounds):
            while one_at_a_time and not subs.polling():  # the sender is back in its poll
                time.sleep(0.0001)
            subs.submitted([uid])
            subs.publish([TokenDelta(uid, 1, hops=FirstTokenHops(0.0, 0.0, sampled_at=time.perf_counter()))])
            _python_for(0.015)  # the scheduler thread goes on to its next step, holding the interpreter
            assert taken.acquire(timeout=10)  # the sender has it (what is measured is its flush_s)
            if one_at_a_time:
                subs.aborted([uid])
    finally:
        done.set()
        thread.join()
    return flushes


def test_publish_does_not_wait_without_a_waiting_poll(monkeypatch):
    from cluster.replica import subscribers

    monkeypatch.setattr(subscribers, "HANDOVER_S", 60.0)  # a wait would be plain
    subs = subscribers.Subscribers()
    subs.submitted([1])
    start = time.perf_counter()
    subs.publish([TokenDelta(1, 1, hops=FirstTokenHops(0.0, 0.0, sampled_at=time.perf_counter()))])
    subs.publish([TokenDelta(1, 2)])
    assert time.perf_counter() - start < 30  # nobody polls: nothing to hand over
    assert [d.token for d in subs.poll(0.0)] == [1, 2]


def _python_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_the_replicas_prefill_hop_ends_where_the_prompts_launch_returns(monkeypatch, overlap):
    """request_prefill is the host's launching of the prompt (every chunk); request_first_sample what
    follows to the first token on the host: the device's work the host waits for and, under overlap, the
    next step's launch. On a clock that only the scripted device moves: a prompt chunk's launch takes 3 s,
    a decode step's 1 s and each wait 5 s."""
    import types

    from scripted import scripted_scheduler

    import cluster.scheduler.batch_builder as builder_module
    import cluster.scheduler.scheduler as scheduler_module

    clock = [100.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic)
    monkeypatch.setattr(scheduler_module, "time", fake)
    monkeypatch.setattr(builder_module, "time", fake)
    run = scripted_scheduler(overlap=overlap, max_extend_tokens=8)
    launch, wait = run.executor.launch, run.executor.wait

    def timed_launch(desc):
        out = launch(desc)
        clock[0] += 3.0 if desc.is_prefill else 1.0
        return out

    def timed_wait(out):
        clock[0] += 5.0
        return wait(out)

    run.executor.launch, run.executor.wait = timed_launch, timed_wait
    run.submit(0, list(range(1, 13)), max_tokens=3)  # 12 tokens: chunks of 8 and 4
    run.run()
    hops = next(d.hops for d in run.deltas if d.hops is not None)
    assert [d.extend_lens.tolist() for d in run.executor.launched if d.is_prefill] == [[8], [4]]
    if overlap:
        # chunk 1 launched (3), chunk 2 launched (3): the prompt's launch; then chunk 1's tokens waited
        # for (5) and, one request being few (FIRST_TOKEN_FIRST_MAX_LIVE), chunk 2's tokens (5) before the
        # decode step's launch
        assert (hops.prefill_s, hops.first_sample_s) == (6.0, 10.0)
    else:
        # chunk 1 launched (3) and waited for (5), chunk 2 launched (3): the prompt's launch; its wait (5)
        assert (hops.prefill_s, hops.first_sample_s) == (11.0, 5.0)
    run.check()


def test_a_replica_records_a_first_tokens_hops_at_its_routers_next_poll_after_sending_them(scripted):
    """A histogram's record lets go of the interpreter: the hops handed out by one poll go into the
    replica's metrics at the next poll of that router, after the answer went out, and once each."""
    from test_kv_events import in_process_replica

    from cluster import AddRequest, SamplingParams

    actor, _ = in_process_replica(scripted)
    recorded = []
    actor.metrics.on_first_token = recorded.append
    actor.submit([AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))], subscriber=2)
    hops = []
    while not hops:  # until the first token is out
        actor.scheduler.step()
        hops = [d.hops for d in actor.poll(0.0, subscriber=2) if d.hops is not None]
    assert len(hops) == 1 and recorded == []  # not while the answer is on its way
    assert list(actor.poll(0.0, subscriber=0)) == [] and recorded == []  # another router's poll records none
    while actor.scheduler.has_work:
        actor.scheduler.step()
    rest = actor.poll(0.0, subscriber=2)
    assert rest and all(d.hops is None for d in rest)
    assert recorded == hops
    actor.poll(0.0, subscriber=2)
    assert recorded == hops  # once


def test_a_released_routers_last_first_tokens_are_recorded_at_its_release(scripted):
    from test_kv_events import in_process_replica

    from cluster import AddRequest, SamplingParams

    actor, _ = in_process_replica(scripted)
    recorded = []
    actor.metrics.on_first_token = recorded.append
    actor.submit([AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))], subscriber=3)
    hops = []
    while not hops:
        actor.scheduler.step()
        hops = [d.hops for d in actor.poll(0.0, subscriber=3) if d.hops is not None]
    assert recorded == []
    assert actor.release_subscriber(3) == 1  # its request aborted with it
    assert recorded == hops
