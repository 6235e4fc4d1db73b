"""Admission: a replica's waiting queue is bounded by max_queued_requests and max_queued_tokens
(unbounded by default). Beyond them a request is refused, as OVERLOADED (HTTP 429 with Retry-After),
by the router before it is sent and by the replica itself; what was accepted runs to its end. Within
the queue, a request's priority (lower first) decides who is admitted next."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fixtures import PROMPT_TEXTS
from helpers import checked_llm, greedy, serving
from scripted import TOKEN

from cluster import LLM, ErrorKind, OverloadedError, SamplingParams
from cluster.messages import AddRequest
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from router.replicas.client import ReplicaClient
from router.replicas.routing import CacheAware, with_room

LOOPS = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
C = "/v1/completions"


def refused(run) -> set[int]:
    return {d.uid for d in run.deltas if d.error_kind is ErrorKind.OVERLOADED}


@LOOPS
def test_requests_beyond_max_queued_requests_are_refused_and_the_accepted_ones_run(scripted, overlap):
    run = scripted(max_queued_requests=2, overlap=overlap)
    for uid in range(5):  # all arrive before the next step: two fit the queue
        run.submit(uid, [uid + 1] * 6, max_tokens=4)
    run.scheduler.receive()
    assert run.scheduler.snapshot().waiting == 2  # what the raylm_num_queue_reqs gauge reports
    run.run()
    assert refused(run) == {2, 3, 4}
    assert all(d.finished and d.token is None and "busy" in d.error for d in run.deltas if d.uid in refused(run))
    assert [run.tokens(uid) for uid in (0, 1)] == [[TOKEN] * 4] * 2 and run.ended == {0: "length", 1: "length"}
    run.submit(9, [1, 2, 3], max_tokens=2)  # the queue drained: accepted again
    run.run()
    assert run.tokens(9) == [TOKEN] * 2 and run.scheduler.snapshot().waiting == 0
    run.check()


def test_max_queued_tokens_bounds_the_waiting_prompt_tokens_but_an_empty_queue_takes_any_prompt(scripted):
    run = scripted(max_queued_tokens=10)
    run.submit(0, [1] * 4, max_tokens=2)
    run.submit(1, [2] * 6, max_tokens=2)  # 10 tokens wait: at the bound
    run.submit(2, [3], max_tokens=2)  # 11: refused
    run.run()
    run.submit(3, [4] * 30, max_tokens=2)  # longer than the bound, into an empty queue
    run.run()
    assert refused(run) == {2}
    assert {uid: len(run.tokens(uid)) for uid in (0, 1, 3)} == {0: 2, 1: 2, 3: 2}
    assert run.scheduler.prefill.queued_tokens == 0
    run.check()


@LOOPS
def test_a_preempted_request_goes_back_to_a_full_queue_and_loses_no_token(scripted, overlap):
    # the preemption test's setup (16 pages, each request grows past its reservation), with a queue of one
    run = scripted(num_pages=16, page_size=4, decode_reserve_tokens=1, max_queued_requests=1, overlap=overlap)
    for uid in range(4):
        run.submit(uid, [uid + 1] * 8, max_tokens=24, ignore_eos=True)
        run.scheduler.step()  # admitted before the next arrives
    run.run()
    assert sum(run.preempted.values()) > 0 and not refused(run)
    assert [len(run.tokens(uid)) for uid in range(4)] == [24] * 4
    run.check()


def test_offline_generate_raises_overloaded_only_when_bounds_are_set(qwen3_path):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    with checked_llm(qwen3_path, max_queued_requests=1) as llm:
        with pytest.raises(OverloadedError, match="busy"):
            llm.generate(prompts, greedy(3))
        assert len(llm.generate(prompts[:1], greedy(3, ignore_eos=True))[0].token_ids) == 3  # serves on
    with checked_llm(qwen3_path) as llm:  # unbounded by default
        assert [len(o.token_ids) for o in llm.generate(prompts, greedy(3, ignore_eos=True))] == [3] * 3


def test_the_router_picks_a_replica_whose_queue_has_room_and_refuses_when_none_has():
    full, spare = (ReplicaClient(i, None) for i in range(2))  # not connected: what it sends waits

    async def route() -> None:
        for uid in range(2):  # sent, no token yet: two wait in replica 0's queue as the router sees it
            full.submit(uid, [1, 2, 3], SamplingParams())
        assert with_room([full, spare], 3, 2, None) == [spare]
        assert CacheAware().pick(with_room([full, spare], 3, None, 8), [1, 2, 3]) is spare  # 6 + 3 tokens > 8
        spare.submit(2, [4] * 20, SamplingParams())  # over the token bound, but it came into an empty queue
        with pytest.raises(OverloadedError):
            with_room([full, spare], 3, 2, 8)
        full.abort(0)
        assert with_room([full, spare], 3, 2, None) == [full, spare] and full.queued_tokens == 3

    asyncio.run(route())


def _body(prompt: str, stream: bool = False, priority: int = 0) -> dict:
    """One greedy completion of 8 tokens."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "priority": priority,
    }


def test_offline_a_high_priority_request_starts_before_low_priority_ones_and_tokens_do_not_change(qwen3_path):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13, 14]]
    with checked_llm(qwen3_path, max_running_reqs=1) as llm:
        plain = llm.generate(prompts, greedy(4, ignore_eos=True))
        started: list[int] = []
        collect = llm.scheduler.on_output

        def spy(deltas):
            started.extend(d.uid for d in deltas if d.uid not in started)
            collect(deltas)

        llm.scheduler.on_output = spy
        params = [greedy(4, ignore_eos=True, priority=p) for p in (5, 5, 5, -1)]
        ordered = llm.generate(prompts, params)
    first = min(started)  # the first prompt's request id
    assert [uid - first for uid in started] == [3, 0, 1, 2]  # priority -1 first, then the rest as they came
    assert [o.token_ids for o in ordered] == [o.token_ids for o in plain]


def test_priority_is_a_strict_int_in_both_request_bodies():
    assert CompletionRequest(model="m", prompt="x").priority == 0
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], priority=-3).priority == -3
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="x", priority="1")


async def _completion(
    http: httpx.AsyncClient, prompt: str, stream: bool, priority: int = 0
) -> tuple[int, dict, str | dict]:
    """(status, headers, the text or the error object) of one completion."""
    body = _body(prompt, stream, priority)
    if not stream:
        r = await http.post(C, json=body)
        return r.status_code, r.headers, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()
    async with http.stream("POST", C, json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.headers, json.loads(await r.aread())
        lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    if "error" in events[-1]:  # refused by the replica after the router sent it
        return events[-1]["error"]["code"], {}, events[-1]
    return 200, r.headers, "".join(e["choices"][0]["text"] for e in events)


def _wait_idle(srv) -> None:
    import ray

    deadline = time.monotonic() + 20
    while ray.get(srv.replicas[0].actor.stats.remote()).live and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.get(srv.replicas[0].actor.check_integrity.remote())


def test_a_flood_beyond_the_bounds_gets_full_outputs_or_real_429s_and_the_server_serves_on(ray_cluster, qwen3_path):
    import ray

    prompts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] + f" {i}" for i in range(24)]
    with LLM(str(qwen3_path)) as llm:
        expected = [o.text for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    with serving(qwen3_path, num_pages=512, max_running_reqs=2, max_queued_requests=3, max_queued_tokens=200) as srv:

        async def flood():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                # every other one streamed; priorities -1, 0 and 1 in turn (they change no token)
                return await asyncio.gather(
                    *(_completion(http, p, i % 2 == 0, i % 3 - 1) for i, p in enumerate(prompts))
                )

        results = asyncio.run(flood())
        done = [i for i, (status, _, _) in enumerate(results) if status == 200]
        busy = [i for i, (status, _, _) in enumerate(results) if status == 429]
        assert done and busy and sorted(done + busy) == list(range(24))
        assert [results[i][2] for i in done] == [expected[i] for i in done]
        for i in busy:
            status, headers, error = results[i]
            assert error["error"]["type"] == "rate_limit_error" and "busy" in error["error"]["message"]
            # a real 429, a stream's too: each request is sent as it is admitted, so the next one's room
            # check counts it (in-stream refusals are left for what one router cannot see)
            assert int(headers["retry-after"]) >= 1
        after = httpx.post(srv.url + C, json=_body(prompts[0]), timeout=60)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected[0]
        _wait_idle(srv)
        assert ray.get(srv.replicas[0].actor.stats.remote()).waiting == 0


def test_a_replica_refuses_what_the_router_could_not_know_was_too_much(ray_cluster, qwen3_path):
    import ray

    with serving(qwen3_path, num_pages=512, max_running_reqs=1, max_queued_requests=1) as srv:
        actor = srv.replicas[0].actor
        # sent past the router (as a second router would): one runs long, one waits behind it
        hidden = [
            AddRequest(10**9 + i, [5, 6, 7], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
            for i in range(2)
        ]
        for request, (running, waiting) in zip(hidden, [(1, 0), (1, 1)]):
            ray.get(actor.submit.remote([request]))
            deadline = time.monotonic() + 20
            while (stats := ray.get(actor.stats.remote())).running != running or stats.waiting != waiting:
                assert time.monotonic() < deadline, stats
                time.sleep(0.02)

        metrics = httpx.get(srv.url + "/metrics", timeout=60).text  # the waiting gauge, read from the replica
        assert 'raylm:num_queue_reqs{model="tiny",replica="0"} 1.0' in metrics

        async def both():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await _completion(http, "hello", False), await _completion(http, "hello", True)

        (status, headers, error), (stream_code, _, event) = asyncio.run(both())
        ray.get(actor.abort.remote([r.uid for r in hidden]))
        assert status == 429 and headers["retry-after"] == "1" and error["error"]["type"] == "rate_limit_error"
        assert stream_code == 429 and event["error"]["type"] == "rate_limit_error"
        _wait_idle(srv)
        assert httpx.post(srv.url + C, json=_body("hello"), timeout=60).status_code == 200
        _wait_idle(srv)


def test_the_routers_own_refusals_are_counted_as_rejected(ray_cluster, qwen3_path):
    import threading

    import ray

    with serving(qwen3_path, num_pages=512, max_running_reqs=1, max_queued_requests=1) as srv:
        actor = srv.replicas[0].actor
        first = threading.Event()

        def long_stream() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first.set()

        running = threading.Thread(target=long_stream)
        running.start()
        assert first.wait(30)  # it runs: the only request slot is taken
        waiting = threading.Thread(target=lambda: httpx.post(srv.url + C, json=_body("Hi"), timeout=60))
        waiting.start()
        deadline = time.monotonic() + 20
        while ray.get(actor.stats.remote()).waiting != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(srv.url + C, json=_body("Hey"), timeout=60)  # the router knows the queue is full
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'raylm:request_failure_total{model="tiny",reason="rejected"} 1.0' in metrics, metrics
        assert 'finish_reason="rejected"' not in metrics
        running.join(60)
        waiting.join(60)
