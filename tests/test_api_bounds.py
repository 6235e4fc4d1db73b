"""Input at the API's bounds, as a fuzzer sent it: each is a 400 naming its field (Anthropic's error
shape on /v1/messages), never a 5xx, and the server serves on. A top_k past int32 used to take the
replica down; a grammar that matches nothing was a server fault; typed stream_options; top_logprobs
without logprobs; JSON nested past the parser's depth and lone surrogates on the Messages and Responses
routes; schema keywords a grammar would not enforce, refused only where a grammar applies; Anthropic's
fields this server does not serve."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import serving

C, CHAT, RESPONSES, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"
USER = [{"role": "user", "content": "Hi"}]
BODIES = {
    C: {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 2},
    RESPONSES: {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
    MESSAGES: {"model": "tiny", "messages": USER, "max_tokens": 2},
}


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=256, max_running_reqs=8, page_size=4) as server:
        yield server


def post(srv, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(srv.url + path, content=body, headers=headers, timeout=60)
    return httpx.post(srv.url + path, json=body, timeout=60)


def refused(r: httpx.Response, path: str) -> dict:
    """The 400's error object (OpenAI's, or Anthropic's on /v1/messages)."""
    assert r.status_code == 400, r.text
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


def serves(srv) -> None:
    assert post(srv, C, BODIES[C]).status_code == 200


@pytest.mark.parametrize("path", [C, CHAT, RESPONSES, MESSAGES])
def test_a_top_k_past_int32_is_a_400_and_the_replica_serves_on(srv, path):
    error = refused(post(srv, path, {**BODIES[path], "top_k": 2**31}), path)
    assert "top_k" in error["message"] and (path == MESSAGES or error["param"] == "top_k"), error
    serves(srv)


def test_a_grammar_that_matches_nothing_is_the_callers_error(srv):
    body = {**BODIES[C], "structured_outputs": {"regex": "[^\\s\\S]"}}
    r = post(srv, C, body)
    assert r.status_code == 400, r.text
    assert "allows no token" in r.json()["error"]["message"]
    serves(srv)


def test_stream_options_are_typed(srv):
    body = {**BODIES[CHAT], "stream": True, "stream_options": {"include_usage": "false"}}
    assert refused(post(srv, CHAT, body), CHAT)["param"].startswith("stream_options")


def test_top_logprobs_without_logprobs_is_a_400(srv):
    assert refused(post(srv, CHAT, {**BODIES[CHAT], "top_logprobs": 3}), CHAT)["param"] == "top_logprobs"


@pytest.mark.parametrize("path", [MESSAGES, "/v1/messages/count_tokens", RESPONSES])
def test_deep_json_and_lone_surrogates_are_400s_on_every_route(srv, path):
    kind = MESSAGES if path.startswith(MESSAGES) else path
    deep = refused(post(srv, path, b"[" * 3000 + b"]" * 3000), kind)
    assert deep["type"] == "invalid_request_error" and deep["message"], deep
    raw = json.dumps({**BODIES[RESPONSES if path == RESPONSES else MESSAGES], "model": "@"}).replace("@", "\\ud800")
    surrogate = refused(post(srv, path, raw.encode()), kind)
    assert "Unicode" in surrogate["message"] and "model" in surrogate["message"], surrogate
    serves(srv)


SET_OF_TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
}


def test_schema_keywords_a_grammar_would_not_enforce_are_refused_where_a_grammar_applies(srv):
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": SET_OF_TAGS}}
    error = refused(post(srv, CHAT, {**BODIES[CHAT], "response_format": schema}), CHAT)
    assert error["param"] == "response_format" and "properties/tags/uniqueItems" in error["message"]
    both = {"allOf": [{"type": "object"}, {"required": ["a"]}]}
    assert refused(post(srv, CHAT, {**BODIES[CHAT], "guided_json": both}), CHAT)["param"] == "guided_json"
    union = {"oneOf": [{"type": "integer"}, {"type": "string"}]}  # generated as anyOf: served
    assert post(srv, CHAT, {**BODIES[CHAT], "guided_json": union}).status_code == 200
    tool = {"type": "function", "function": {"name": "tag", "parameters": SET_OF_TAGS}}
    # a tool's parameters are only rendered for the model to read unless a call is forced (this model's
    # template renders no tools: under "auto" they are refused for that, not for the keyword)
    unforced = refused(post(srv, CHAT, {**BODIES[CHAT], "tools": [tool]}), CHAT)
    assert unforced["param"] == "tools" and "does not render tools" in unforced["message"]
    forced = {**BODIES[CHAT], "tools": [tool], "tool_choice": "required"}
    assert refused(post(srv, CHAT, forced), CHAT)["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("field", ["output_format", "output_config", "mcp_servers"])
def test_anthropic_fields_this_server_does_not_serve_are_400s_naming_them(srv, field):
    value = [] if field == "mcp_servers" else {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert field in refused(post(srv, MESSAGES, {**BODIES[MESSAGES], field: value}), MESSAGES)["message"]


def test_a_prompt_list_past_max_prompts_is_refused_before_any_work_and_one_at_it_is_served(srv):
    """A batch of 100,000 prompts once held the replica long enough that its channel to the router was
    taken for lost, failing other clients' requests: the list is bounded (OpenAI's 2,048 by default)."""
    limit = srv.config.max_prompts
    error = refused(post(srv, C, {**BODIES[C], "prompt": ["x"] * (limit + 1)}), C)
    assert error["param"] == "prompt" and str(limit) in error["message"], error
    served = post(srv, C, {**BODIES[C], "prompt": [[1, 2]] * 3, "max_tokens": 1})
    assert served.status_code == 200 and len(served.json()["choices"]) == 3
    serves(srv)


def test_prompts_times_n_past_max_prompts_is_a_400_naming_n(srv):
    """2,048 prompts at n 16 were 32,768 sequences, which held the replica for minutes."""
    limit = srv.config.max_prompts
    error = refused(post(srv, C, {**BODIES[C], "prompt": [[1, 2]] * (limit // 2 + 1), "n": 2}), C)
    assert error["param"] == "n" and str(limit) in error["message"], error
    serves(srv)


@pytest.mark.parametrize("path", [C, CHAT, RESPONSES])
def test_an_empty_body_and_a_nan_are_named_as_such(srv, path):
    empty = httpx.post(srv.url + path, headers={"content-type": "application/json"}, timeout=60)
    assert empty.status_code == 400 and "body is empty" in empty.json()["error"]["message"], empty.text
    body = json.dumps({**BODIES[path], "temperature": 0.5}).replace("0.5", "NaN").encode()
    error = refused(post(srv, path, body), path)
    assert error["param"] == "temperature" and "finite" in error["message"], error
    serves(srv)


@pytest.mark.parametrize(
    "part, where",
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "messages.0.content.1.type"),
        ({"type": "text", "text": 5}, "messages.0.content.1.text"),
    ],
)
def test_a_content_part_this_server_cannot_take_is_named_by_its_index(srv, part, where):
    content = [{"type": "text", "text": "What is in it?"}, part]
    error = refused(post(srv, CHAT, {**BODIES[CHAT], "messages": [{"role": "user", "content": content}]}), CHAT)
    assert error["param"] == where and error["message"].startswith(where), error


@pytest.mark.parametrize(
    "path, key, meant",
    [
        (C, "max_token", "max_tokens"),
        (C, "temprature", "temperature"),
        (CHAT, "top_logprob", "top_logprobs"),
        (RESPONSES, "max_output_token", "max_output_tokens"),
        (MESSAGES, "stop_sequence", "stop_sequences"),
    ],
)
def test_a_misspelled_field_is_a_400_naming_it_and_the_field_it_nearly_is(srv, path, key, meant):
    """Ignored, max_token would leave the output at the default length without a word."""
    error = refused(post(srv, path, {**BODIES[path], key: 1}), path)
    if path != MESSAGES:  # Anthropic's error has no param
        assert error["param"] == key, error
    assert key in error["message"] and f"did you mean {meant}?" in error["message"], error


def test_a_misspelled_key_of_a_message_is_named_by_its_place(srv):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "contnet": "Hi"}]
    error = refused(post(srv, CHAT, {**BODIES[CHAT], "messages": messages}), CHAT)
    assert error["param"] == "messages.1.contnet" and "did you mean content?" in error["message"], error


def test_another_servers_field_is_ignored_as_before(srv):
    """Keys that are no field's near miss are served around: TGI's max_new_tokens, a client's own, and other
    servers' fields close to one here (OpenRouter's models, llama.cpp's reasoning_format, parse_tool_calls and
    return_tokens, SGLang's top_logprobs_num)."""
    for path in (C, CHAT, RESPONSES, MESSAGES):
        foreign = {"max_new_tokens": 5, "x_trace": "abc", "models": ["a"], "reasoning_format": "none"}
        foreign |= {"parse_tool_calls": True, "return_tokens": True, "top_logprobs_num": 2}
        r = post(srv, path, {**BODIES[path], **foreign})
        assert r.status_code == 200, r.text
