"""The HTTP server end to end: real replicas on Ray, uvicorn on 127.0.0.1, the real openai client.
Outputs must equal the offline engine's; disconnects must free pages."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from fixtures import PROMPT_TEXTS
from helpers import client, concurrent_completions, greedy, serving

from cluster import LLM


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["2-replicas-tp1", "1-replica-tp2"])
def server(request, ray_cluster, qwen3_path):
    replicas, tp = request.param
    with serving(qwen3_path, replicas=replicas, tp_size=tp, num_pages=2048, max_running_reqs=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(qwen3_path):
    """The offline engine's greedy outputs: what the server must reproduce."""
    with LLM(str(qwen3_path)) as llm:

        def run(prompts: list[str] | list[list[int]], max_tokens: int):
            return llm.generate(prompts, greedy(max_tokens))

        run.tokenizer = llm.tokenizer
        yield run


def wait_until_idle(srv, timeout_s: float = 20.0) -> list[dict]:
    """Every replica's stats once no request is live there (a bounded wait for an eventual state)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get([r.actor.stats.remote() for r in srv.replicas])
        if all(s.live == 0 for s in stats) or time.monotonic() > deadline:
            return stats


def check_replicas_whole(srv) -> None:
    import ray

    stats = wait_until_idle(srv)
    assert [s.live for s in stats] == [0] * len(stats)
    ray.get([r.actor.check_integrity.remote() for r in srv.replicas])


def test_completions_equal_the_offline_engine(server, offline):
    expected = offline(PROMPT_TEXTS[:6], 12)
    c = client(server)
    for prompt, exp in zip(PROMPT_TEXTS[:6], expected):
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == exp.text
        assert r.choices[0].finish_reason == exp.finish_reason
        assert r.usage.completion_tokens == len(exp.token_ids)
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    check_replicas_whole(server)


def test_streamed_completion_equals_the_whole_one(server):
    c = client(server)
    whole = c.completions.create(model="tiny", prompt=PROMPT_TEXTS[3], max_tokens=16, temperature=0)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=PROMPT_TEXTS[3],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_completion_applies_the_template_and_streams(server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT_TEXTS[1]}]
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = offline.tokenizer(text, add_special_tokens=False).input_ids
    expected = offline([ids], 10)[0]
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_32_concurrent_requests_each_equal_the_offline_engine(server, offline):
    prompts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] + f" {i}" for i in range(32)]
    expected = offline(prompts, 8)
    assert concurrent_completions(server.url, prompts, 8) == [e.text for e in expected]
    check_replicas_whole(server)


def test_stop_string_spanning_tokens_ends_the_text_before_it(server, offline):
    exp = offline([PROMPT_TEXTS[6]], 20)[0]
    tok = offline.tokenizer
    pieces = [tok.decode(exp.token_ids[:i], skip_special_tokens=True) for i in range(len(exp.token_ids) + 1)]
    # a stop string made of the end of token 3's text and the start of token 4's and 5's
    start, end = len(pieces[3]) - 1, len(pieces[5])
    stop = exp.text[start:end]
    r = client(server).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[6], max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == exp.text[: exp.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    check_replicas_whole(server)


def test_logprobs_are_returned_for_the_generated_tokens(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    # keyed by token text: tokens that decode alike (partial UTF-8 bytes) share one key
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-4 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    body = {
        "model": "tiny",
        "prompt": PROMPT_TEXTS[4],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    decoded_before = sum(s.decode_tokens for s in wait_until_idle(server))
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: {") for line in got)
    stats = wait_until_idle(server)
    assert [s.live for s in stats] == [0] * len(stats)
    # far fewer than its 400 tokens were decoded: the abort landed within a few steps
    assert sum(s.decode_tokens for s in stats) - decoded_before < 200
    check_replicas_whole(server)


def test_health_models_and_metrics_endpoints(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    text = httpx.get(server.url + "/metrics").text
    assert "raylm:generation_tokens_total" in text and "raylm:time_to_first_token_seconds" in text


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"model": "tiny", "prompt": "hi", "n": 17}, 400, "n"),  # above max_n (16)
        ({"model": "tiny", "prompt": "hi " * 600, "max_tokens": 4}, 400, "prompt"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ],
)
def test_bad_requests_get_openai_style_errors(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_preempted_streams_get_the_same_tokens(ray_cluster, qwen3_path, offline):
    """Too few KV pages for every request's growth: the replica preempts and recomputes some, and no
    client can tell from its stream."""
    import ray

    prompts = [PROMPT_TEXTS[i % 11] + f" {i}" for i in range(16)]
    expected = offline(prompts, 30)
    with serving(qwen3_path, replicas=1, tp_size=1, num_pages=100, decode_reserve_tokens=2) as srv:
        aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

        async def one(prompt: str) -> str:
            chunks = await aclient.completions.create(
                model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True
            )
            return "".join([ch.choices[0].text async for ch in chunks])

        async def all_of_them():
            try:
                return await asyncio.gather(*(one(p) for p in prompts))
            finally:
                await aclient.close()

        texts = asyncio.run(all_of_them())
        assert ray.get(srv.replicas[0].actor.stats.remote()).preempted > 0
        check_replicas_whole(srv)
    assert texts == [e.text for e in expected]


def test_the_ray_this_server_starts_runs_its_workers_at_the_starters_priority(ray_cluster):
    """Ray starts workers at nice 15 unless told otherwise: a replica's scheduler loop would give way to any
    other process on the host, the server's own HTTP side first."""
    import os

    @ray_cluster.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray_cluster.get(niceness.remote()) == os.nice(0)
