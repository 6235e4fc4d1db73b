"""Hostile and malformed input, access control and time limits: each gets a clear error and the server
keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import serving

from cluster.config import ServeConfig

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def guarded(ray_cluster, qwen3_path):
    with serving(
        qwen3_path,
        num_pages=1024,
        max_running_reqs=16,
        api_key=KEY,
        max_body_bytes=64_000,
        max_stop_strings=4,
        max_tokens_limit=256,
        request_timeout_s=60,
    ) as srv:
        yield srv


AUTH = {"Authorization": f"Bearer {KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "Hello"}]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _any_of(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


BAD = [  # (name, path, body (dict, or bytes sent raw), expected status)
    ("invalid json", C, b'{"model": "tiny", "prompt": ', 400),
    ("json array", C, b"[1, 2, 3]", 400),
    ("invalid utf-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
    ("missing prompt", C, {"model": "tiny"}, 400),
    ("missing model", C, {"prompt": "hi"}, 400),
    ("prompt wrong type", C, {"model": "tiny", "prompt": 12}, 400),
    ("prompt dict", C, {"model": "tiny", "prompt": {"a": 1}}, 400),
    ("max_tokens negative", C, {**OK, "max_tokens": -1}, 400),
    ("max_tokens zero", C, {**OK, "max_tokens": 0}, 400),
    ("max_tokens huge", C, {**OK, "max_tokens": 10**12}, 400),
    ("max_tokens over the limit", C, {**OK, "max_tokens": 300}, 400),
    ("max_tokens string", C, {**OK, "max_tokens": "many"}, 400),
    ("temperature negative", C, {**OK, "temperature": -0.5}, 400),
    ("temperature string", C, {**OK, "temperature": "hot"}, 400),
    ("top_p zero", C, {**OK, "top_p": 0}, 400),
    ("top_p above one", C, {**OK, "top_p": 1.5}, 400),
    ("top_k below -1", C, {**OK, "top_k": -2}, 400),
    ("seed above 64 bits", C, {**OK, "seed": 2**64}, 400),
    ("seed below 64 bits", C, {**OK, "seed": -(2**63) - 1}, 400),
    ("prompt over the context", C, {**OK, "prompt": "hello " * 2000}, 400),
    ("empty prompt", C, {**OK, "prompt": ""}, 400),
    ("empty token list", C, {**OK, "prompt": []}, 400),
    ("token id out of vocabulary", C, {**OK, "prompt": [1, 2, 10**6]}, 400),
    ("negative token id", C, {**OK, "prompt": [1, -5]}, 400),
    ("an empty prompt among several", C, {**OK, "prompt": ["a", ""]}, 400),
    ("unknown model", C, {**OK, "model": "gpt-5"}, 404),
    ("n above the limit", C, {**OK, "n": 17}, 400),
    ("huge n", C, {**OK, "n": 10**9}, 400),
    ("oversized body", C, {**OK, "prompt": "x" * 100_000}, 413),
    ("too many stop strings", C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("empty stop string", C, {**OK, "stop": [""]}, 400),
    ("stop wrong type", C, {**OK, "stop": 5}, 400),
    ("stop token id out of vocabulary", C, {**OK, "stop_token_ids": [10**7]}, 400),
    ("logprobs too many", C, {**OK, "logprobs": 50}, 400),
    ("chat without messages", CHAT, {"model": "tiny"}, 400),
    ("chat empty messages", CHAT, {"model": "tiny", "messages": []}, 400),
    ("chat bad role", CHAT, {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("chat message not an object", CHAT, {"model": "tiny", "messages": ["hi"]}, 400),
    (
        "chat image content",
        CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        400,
    ),
    ("chat top_logprobs too many", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 99}, 400),
    ("chat max_completion_tokens zero", CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": 0}, 400),
    # text that is not valid Unicode: JSON allows a lone surrogate, no tokenizer can encode one
    ("lone surrogate in the prompt", C, {**OK, "prompt": "hi \ud800"}, 400),
    ("lone surrogate in a prompt list", C, {**OK, "prompt": ["\udfff"]}, 400),
    ("lone surrogate in the model", C, {**OK, "model": "tiny\ud800"}, 400),
    ("lone surrogate in a stop string", C, {**OK, "stop": ["\ud800"]}, 400),
    ("lone surrogate in a message", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}, 400),
    (
        "lone surrogate in a content part",
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        400,
    ),
    # strict types, as OpenAI's API has them: no coercion
    ("stream as a string", C, {**OK, "stream": "yes"}, 400),
    ("stream as a number", C, {**OK, "stream": 1}, 400),
    ("max_tokens as a boolean", C, {**OK, "max_tokens": True}, 400),
    ("max_tokens as a float", C, {**OK, "max_tokens": 2.5}, 400),
    ("max_tokens as a numeric string", C, {**OK, "max_tokens": "2"}, 400),
    ("ignore_eos as a string", C, {**OK, "ignore_eos": "true"}, 400),
    ("seed as a float", C, {**OK, "seed": 1.5}, 400),
    ("top_k as a string", C, {**OK, "top_k": "5"}, 400),
    ("temperature as a boolean", C, {**OK, "temperature": True}, 400),
    ("logprobs as a boolean on completions", C, {**OK, "logprobs": True}, 400),
    ("stop token ids as strings", C, {**OK, "stop_token_ids": ["1"]}, 400),
    ("stream_options not an object", C, {**OK, "stream": True, "stream_options": "usage"}, 400),
    ("chat logprobs as a string", CHAT, {"model": "tiny", "messages": MSG, "logprobs": "yes"}, 400),
    ("chat content as a number", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400),
    ("chat message without a role", CHAT, {"model": "tiny", "messages": [{"content": "hi"}]}, 400),
    # sampling values outside their ranges (tests/test_sampling_api.py has every bound)
    ("logit_bias", C, {**OK, "logit_bias": {"5": 101}}, 400),
    ("presence_penalty", C, {**OK, "presence_penalty": 2.5}, 400),
    ("frequency_penalty", CHAT, {"model": "tiny", "messages": MSG, "frequency_penalty": -3}, 400),
    ("repetition_penalty", C, {**OK, "repetition_penalty": 0}, 400),
    ("min_p", C, {**OK, "min_p": 1.5}, 400),
    ("min_tokens", C, {**OK, "min_tokens": 3}, 400),  # above max_tokens (2)
    # bad schemas and tool choices (tests/test_structured_api.py has the rest)
    (
        "tools",
        CHAT,
        {
            "model": "tiny",
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
        },
        400,
    ),
    ("tool_choice required", CHAT, {"model": "tiny", "messages": MSG, "tool_choice": "required"}, 400),
    (
        "response_format",
        CHAT,
        {
            "model": "tiny",
            "messages": MSG,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
        400,
    ),
    ("guided_json", C, {**OK, "guided_json": {"type": "objekt"}}, 400),
    # fields that would change what the request means are refused, never ignored
    ("echo", CHAT, {"model": "tiny", "messages": MSG, "echo": True}, 400),  # a completions field
    ("suffix", C, {**OK, "suffix": "the end"}, 400),
    ("best_of", C, {**OK, "best_of": 2}, 400),
    ("tools on completions", C, {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    # what once reached the handlers and failed there: bounded or refused where the request is read
    ("logit_bias key of 5,000 digits", C, {**OK, "logit_bias": {"1" * 5000: 1}}, 400),
    ("prompt nested 500 deep", C, {**OK, "prompt": _nested(500)}, 400),
    ("stop nested 500 deep", CHAT, {"model": "tiny", "messages": MSG, "stop": _nested(500)}, 400),
    ("guided_json as a string nested 1,500 deep", C, {**OK, "guided_json": "[" * 1500 + "]" * 1500}, 400),
    (
        "response_format nested 200 anyOf deep",
        CHAT,
        {"model": "tiny", "messages": MSG, "response_format": _any_of(200)},
        400,
    ),
    ("user as a number", C, {**OK, "user": 5}, 400),
    ("metadata as a string", CHAT, {"model": "tiny", "messages": MSG, "metadata": "x"}, 400),
    ("metadata value as a number", CHAT, {"model": "tiny", "messages": MSG, "metadata": {"Team-X": 1}}, 400),
]

# what a refused field's message must name
NAMED = {
    "logit_bias key of 5,000 digits": "logit_bias",
    "guided_json as a string nested 1,500 deep": "guided_json",
    "response_format nested 200 anyOf deep": "response_format",
    "user as a number": "user",
    "metadata as a string": "metadata",
    "metadata value as a number": "metadata.Team-X",
    "prompt nested 500 deep": "prompt",
    "stop nested 500 deep": "stop",
    "tools": "tools.0.function.parameters",
    **{
        name: name
        for name in (
            "tool_choice",
            "response_format",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
            "min_tokens",
            "echo",
            "suffix",
            "best_of",
            "guided_json",
        )
    },
}


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_with_an_openai_error_body(guarded, name, path, body, status):
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30) as http:
        # json.dumps escapes a lone surrogate as JSON allows ("\\ud800"); httpx's json= cannot send one
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]
        if name in NAMED:
            field = NAMED[name]
            assert err["param"] == field and field in err["message"], err
        good = http.post(C, json={**OK, "ignore_eos": True})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("echo", False),
        ("best_of", 1),
        ("logit_bias", {}),
        ("tools", []),
        ("suffix", None),
    ],
)
def test_fields_at_their_neutral_value_are_accepted(guarded, field, value):
    r = httpx.post(guarded.url + C, json={**OK, field: value}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_without_a_json_content_type_is_told_so(guarded, content_type):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    r = httpx.post(guarded.url + C, content=json.dumps(OK).encode(), headers=headers, timeout=30)
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_chunked_body_over_the_limit_is_refused(guarded):
    def chunks():
        for _ in range(100):
            yield b" " * 1000

    r = httpx.post(guarded.url + C, content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413


def test_api_key_is_required_on_every_v1_route(guarded):
    for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", CHAT)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, guarded.url + path, headers=headers, json=OK)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200  # probes need no key


def test_binds_loopback_by_default():
    assert ServeConfig().host == "127.0.0.1"


def test_request_timeout_ends_a_slow_request_with_408(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=1024, max_running_reqs=4, request_timeout_s=0.3) as srv:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 450, "ignore_eos": True}
        r = httpx.post(srv.url + C, json=body, timeout=60)
        assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
        with httpx.stream("POST", srv.url + C, json={**body, "stream": True}, timeout=60) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 408
        import ray
        from test_serve import wait_until_idle

        assert [s.live for s in wait_until_idle(srv)] == [0]
        ray.get(srv.replicas[0].actor.check_integrity.remote())
