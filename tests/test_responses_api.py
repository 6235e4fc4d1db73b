"""OpenAI's Responses API with the real openai client (responses.create, .stream, .parse): it serves the
chat request it translates into (the same prompt, the same greedy output, the same tools, formats and
reasoning parser), whole and as the documented event sequence; bad input is a 400 naming the field."""

from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import OPENS_THINKING_TEMPLATE, chat_checkpoint, no_whitespace
from helpers import client, serving
from pydantic import BaseModel
from test_serve import check_replicas_whole

from cluster.model_info import load_tokenizer
from router.http.responses_api.output import failure_code

NO_THINKING = {"effort": "none"}
NO_THINKING_CHAT = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOL = {"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen3_path):
    return chat_checkpoint(qwen3_path, tmp_path_factory.mktemp("responses") / "qwen", OPENS_THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def bias(model):
    return no_whitespace(load_tokenizer(str(model)))


@pytest.fixture(scope="module")
def srv(ray_cluster, model):
    with serving(model, num_pages=1024, max_running_reqs=16) as server:
        yield server


def chat(srv, messages, **kw):
    return client(srv).chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def event_types(events) -> list[str]:
    """The event names with each output item's deltas run together (their number is the model's)."""
    out: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


def test_a_string_input_is_answered_as_the_chat_request_it_means(srv):
    r = client(srv).responses.create(
        model="tiny",
        input="Hello there",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
        reasoning=NO_THINKING,
    )
    c = chat(
        srv,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        extra_body=NO_THINKING_CHAT,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert [item.type for item in r.output] == ["message"]
    reason = c.choices[0].finish_reason
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)
    )
    # set once completed, as OpenAI's
    assert (r.completed_at is not None and r.completed_at >= r.created_at) == (r.status == "completed")


def test_function_calls_and_their_outputs_are_the_conversation_the_template_renders(srv):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client(srv).responses.create(
        model="tiny", input=items, tools=[TOOL], max_output_tokens=4, temperature=0, reasoning=NO_THINKING
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": items[1]["arguments"]}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    c = chat(srv, messages, tools=[CHAT_TOOL], max_tokens=4, extra_body=NO_THINKING_CHAT)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")


TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
# a format that ends the output within a few tokens, so that the response completes
YES_NO = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}


def test_the_stream_is_the_documented_event_sequence_adding_up_to_the_whole(srv):
    args = dict(
        model="tiny", input="Yes or no?", text=YES_NO, max_output_tokens=10, temperature=0, reasoning=NO_THINKING
    )
    whole = client(srv).responses.create(**args)
    with client(srv).responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert whole.status == final.status == "completed"
    assert event_types(events) == TEXT_EVENTS + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and json.loads(deltas) in ("yes", "no")
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stream_cut_at_max_output_tokens_ends_incomplete(srv):
    args = dict(model="tiny", input="Tell me a story", max_output_tokens=6, temperature=0, reasoning=NO_THINKING)
    whole = client(srv).responses.create(**args)
    events = list(client(srv).responses.create(**args, stream=True))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert event_types(events) == TEXT_EVENTS + ["response.incomplete"]
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == 6


def test_max_output_tokens_leaves_the_response_incomplete(srv):
    r = client(srv).responses.create(
        model="tiny", input="Hi", max_output_tokens=1, temperature=0, reasoning=NO_THINKING
    )
    assert r.usage.output_tokens == 1
    if r.status == "incomplete":  # a first token that is the end of the text completes it
        assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"


def test_the_reasoning_parser_output_is_a_reasoning_item(srv):
    # the template opens the think block: random weights think on until max_output_tokens
    r = client(srv).responses.create(model="tiny", input="Think", max_output_tokens=8, temperature=0)
    c = chat(srv, [{"role": "user", "content": "Think"}], max_tokens=8)
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == c.choices[0].message.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert [item.type for item in r.output] == ["reasoning", "message"]  # output_text is there to read
    with client(srv).responses.stream(model="tiny", input="Think", max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response  # response.incomplete: the think block is cut at max_output_tokens
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ""
    assert final.usage.output_tokens_details.reasoning_tokens <= final.usage.output_tokens == 8
    assert event_types(events)[2:7] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
    ]
    part = next(e for e in events if e.type == "response.content_part.done").part
    assert part.type == "reasoning_text" and part.text == r.output[0].content[0].text
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text


def test_a_required_tool_is_a_function_call_item_whose_arguments_validate(srv, bias):
    args = dict(
        model="tiny",
        input="Weather?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
        temperature=0,
        reasoning=NO_THINKING,
        extra_body={"logit_bias": bias},
    )
    r = client(srv).responses.create(**args)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client(srv).responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(c.type, c.name, c.arguments) for c in final.output] == [("function_call", call.name, call.arguments)]
    assert event_types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]


class City(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: Literal[1, 2, 3]


def test_parse_reads_a_json_schema_output_into_its_model(srv, bias):
    r = client(srv).responses.parse(
        model="tiny",
        input="A city and a number of days",
        text_format=City,
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINKING,
        extra_body={"logit_bias": bias},
    )
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    json_mode = client(srv).responses.create(
        model="tiny",
        input="JSON please",
        text={"format": {"type": "json_object"}},
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINKING,
        extra_body={"logit_bias": bias},
    )
    assert json_mode.status == "completed" and isinstance(json.loads(json_mode.output_text), dict)


IMAGE = {"type": "input_image", "image_url": "https://example.com/x.png"}
# a function call's output with no call before it
UNANSWERED = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "input.0.type"),  # was a 500
        ({"input": [{"type": {"a": 1}}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": 3}]}, "input.0.content"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"background": True}, "background"),
        ({"temperature": "hot"}, "temperature"),
        ({"input": [UNANSWERED]}, "input.0.call_id"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, "input.0.content.0.type"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
        ({"input": [{"role": "user", "content": "hi"}, {**UNANSWERED, "call_id": ""}]}, "input.1.call_id"),
        ({"tools": [{**TOOL, "parameters": json.loads('{"a":' * 400 + "1" + "}" * 400)}]}, "tools"),
        # the chat API's fields this API has not: refused, never ignored
        ({"max_tokens": 3}, "max_tokens"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 2}, "n"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(srv, fields, param):
    body = {"model": "tiny", "input": "hi", **fields}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
    assert "[" not in error["param"] and ".str" not in error["param"], error  # field names, not union members


def test_an_unknown_model_is_a_404_the_client_raises(srv):
    with pytest.raises(openai.NotFoundError):
        client(srv).responses.create(model="gpt-none", input="hi")


def test_a_stored_response_is_read_back_and_continues_the_conversation(srv):
    first = client(srv).responses.create(
        model="tiny", input="Name a city", max_output_tokens=5, temperature=0, reasoning=NO_THINKING
    )
    assert client(srv).responses.retrieve(first.id).model_dump() == first.model_dump()
    again = httpx.get(f"{srv.url}/v1/responses/{first.id}", params={"stream": "true"}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream", again.text  # not the JSON body
    second = client(srv).responses.create(
        model="tiny",
        input="And another",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0,
        reasoning=NO_THINKING,
    )
    conversation = [
        {"role": "user", "content": "Name a city"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another"},
    ]
    c = chat(srv, conversation, max_tokens=5, extra_body=NO_THINKING_CHAT)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content


def test_input_tokens_counts_the_prompt_a_response_would_have(srv):
    first = client(srv).responses.create(
        model="tiny",
        input="Name a city",
        instructions="Be brief.",
        tools=[TOOL],
        max_output_tokens=3,
        temperature=0,
        reasoning=NO_THINKING,
    )
    counted = client(srv).responses.input_tokens.count(
        model="tiny", input="Name a city", instructions="Be brief.", tools=[TOOL], reasoning=NO_THINKING
    )
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens
    follow = dict(input="And another", previous_response_id=first.id, reasoning=NO_THINKING)
    second = client(srv).responses.create(model="tiny", max_output_tokens=3, temperature=0, **follow)
    assert client(srv).responses.input_tokens.count(**follow).input_tokens == second.usage.input_tokens  # no model
    with pytest.raises(openai.BadRequestError, match="tools.0.parameters"):
        client(srv).responses.input_tokens.count(
            model="tiny", input="x", tools=[{**TOOL, "parameters": {"type": "array"}}]
        )


def test_a_stored_responses_input_items_are_listed_newest_first_in_pages(srv):
    given = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name"}, {"type": "input_text", "text": "a city"}]},
    ]
    r = client(srv).responses.create(model="tiny", input=given, max_output_tokens=2, reasoning=NO_THINKING)
    listed = client(srv).responses.input_items.list(r.id)
    texts = [[part.text for part in item.content] for item in listed.data]
    assert texts == [["Name", "a city"], ["Be brief."]] and [i.role for i in listed.data] == ["user", "system"]
    assert all(item.id for item in listed.data) and not listed.has_more
    first = client(srv).responses.input_items.list(r.id, limit=1, order="asc")
    assert [i.role for i in first.data] == ["system"] and first.has_more
    rest = client(srv).responses.input_items.list(r.id, order="asc", after=first.data[0].id)
    assert [i.role for i in rest.data] == ["user"]
    plain = client(srv).responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning=NO_THINKING)
    (item,) = client(srv).responses.input_items.list(plain.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi"
    with pytest.raises(openai.NotFoundError):
        client(srv).responses.input_items.list("resp_nowhere")
    for limit in ("abc", "0"):  # a query parameter is named as the client sent it
        bad = httpx.get(f"{srv.url}/v1/responses/{r.id}/input_items", params={"limit": limit}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit", bad.text


def test_a_streamed_response_is_stored_whole(srv):
    with client(srv).responses.stream(
        model="tiny", input="Yes or no?", text=YES_NO, max_output_tokens=10, temperature=0, reasoning=NO_THINKING
    ) as stream:
        final = stream.get_final_response()
    assert client(srv).responses.retrieve(final.id).output_text == final.output_text


def test_a_stream_its_client_leaves_is_stored_incomplete_and_continues(srv, model):
    eos = load_tokenizer(str(model)).eos_token_id
    body = {
        "model": "tiny",
        "input": "Talk",
        "max_output_tokens": 1500,  # EOS banned: it runs for seconds, far past the client
        "logit_bias": {str(eos): -100},
        "reasoning": NO_THINKING,
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        events = (json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: "))
        response_id = next(events)["response"]["id"]
        next(e for e in events if e["type"] == "response.output_text.delta")
    kept = poll_stored(srv, response_id)
    assert kept["status"] == "incomplete" and kept["output"][0]["status"] == "incomplete", kept
    assert kept["output"][0]["content"][0]["text"]
    follow = client(srv).responses.create(
        model="tiny", input="Go on", previous_response_id=response_id, max_output_tokens=1, reasoning=NO_THINKING
    )
    assert follow.status in ("completed", "incomplete")


def poll_stored(srv, response_id: str) -> dict:
    """The stored response, once the server has seen its client leave (a few seconds at most)."""
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(srv.url + f"/v1/responses/{response_id}", timeout=30)
        if r.status_code != 404 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(0.1)


def test_deleted_unstored_and_unknown_responses_are_404s(srv):
    kept = client(srv).responses.create(model="tiny", input="hi", max_output_tokens=2, reasoning=NO_THINKING)
    unstored = client(srv).responses.create(
        model="tiny", input="hi", max_output_tokens=2, reasoning=NO_THINKING, store=False
    )
    assert client(srv).responses.delete(kept.id) is None
    for response_id in (kept.id, unstored.id, "resp_none"):
        with pytest.raises(openai.NotFoundError):
            client(srv).responses.retrieve(response_id)
    r = httpx.post(
        srv.url + "/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": "resp_none"}
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_only_background_responses_can_be_cancelled(srv):
    r = client(srv).responses.create(model="tiny", input="hi", max_output_tokens=2, reasoning=NO_THINKING)
    with pytest.raises(openai.BadRequestError):
        client(srv).responses.cancel(r.id)


def test_the_store_forgets_what_expires_and_the_oldest_past_its_bounds(monkeypatch):
    from router.tier import response_store

    now = [0.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = response_store.ResponseStore(ttl_s=10, max_responses=2, max_bytes=100)
    store.put("a", {"n": 1}, 10)
    store.put("b", {"n": 2}, 10)
    store.put("c", {"n": 3}, 10)  # past max_responses: a goes
    assert [store.get(k) for k in "abc"] == [None, {"n": 2}, {"n": 3}]
    store.put("d", {"n": 4}, 95)  # past max_bytes: the older go
    assert [store.get(k) for k in "bcd"] == [None, None, {"n": 4}]
    now[0] = 11.0
    assert store.get("d") is None


def test_instructions_come_first_and_the_inputs_own_system_messages_stay(srv):
    system, user = {"role": "system", "content": "Answer in French, always."}, {"role": "user", "content": "Hello"}
    r = client(srv).responses.create(
        model="tiny", instructions="Be brief.", input=[system, user], max_output_tokens=2, reasoning=NO_THINKING
    )
    c = chat(srv, [{"role": "system", "content": "Be brief."}, system, user], max_tokens=2, extra_body=NO_THINKING_CHAT)
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_empty_instructions_are_none(srv):
    ask = dict(model="tiny", input="Hello", max_output_tokens=2, reasoning=NO_THINKING)
    bare = client(srv).responses.create(**ask)
    assert client(srv).responses.create(**ask, instructions="").usage.input_tokens == bare.usage.input_tokens


def test_a_stream_that_fails_ends_failed_with_one_code_and_is_kept(srv):
    never = {"format": {"type": "json_schema", "name": "never", "schema": {"type": "string", "pattern": "^[^\\s\\S]$"}}}
    events = list(
        client(srv).responses.create(
            model="tiny", input="Hi", text=never, max_output_tokens=8, reasoning=NO_THINKING, stream=True
        )
    )
    error = next(e for e in events if e.type == "error")
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.error.code == error.code
    assert all(item.status != "completed" for item in failed.response.output)
    assert client(srv).responses.retrieve(failed.response.id).status == "failed"


@pytest.mark.parametrize(
    "error_type, code",
    [
        ("invalid_request_error", "invalid_prompt"),
        ("rate_limit_error", "rate_limit_exceeded"),
        ("timeout_error", "server_error"),
        ("server_error", "server_error"),
        ("service_unavailable", "server_error"),
    ],
)
def test_a_failures_code_follows_its_type(error_type, code):
    assert failure_code({"type": error_type, "code": 400, "message": "x"}) == code


def test_the_echoed_settings_are_those_sent(srv):
    r = client(srv).responses.create(
        model="tiny",
        input="Hi",
        max_output_tokens=1,
        text={"format": {"type": "json_object"}},
        reasoning={"effort": "none", "summary": "auto"},
    )
    assert r.text.format.model_dump(exclude_none=True) == {"type": "json_object"}
    assert r.reasoning.summary == "auto"


def test_the_replicas_are_whole_after_the_responses(srv):
    check_replicas_whole(srv)


def test_a_prompt_served_again_reports_its_prefix_cache_hit_as_cached_tokens(srv):
    ask = dict(model="tiny", input="Cached twice, a prompt of some length", max_output_tokens=2, reasoning=NO_THINKING)
    first = client(srv).responses.create(**ask, instructions="Say it again.")
    again = client(srv).responses.create(**ask, instructions="Say it again.")
    assert again.usage.input_tokens == first.usage.input_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens <= again.usage.input_tokens


def test_every_router_actor_of_the_tier_reads_a_stored_response_even_after_its_maker_is_gone(model):
    import ray

    with serving(model, routers=2, num_pages=256, max_running_reqs=8) as tier:
        made = client(tier).responses.create(model="tiny", input="Remember this", max_output_tokens=2)
        port = tier.config.port

        def read(self, response_id=made.id, port=port):
            from router.tier.response_store import response_store

            return ray.get(response_store(port).get.remote(response_id)) is not None

        # each router actor reaches the one store by name and finds the response there
        assert ray.get([a.__ray_call__.remote(read) for a in tier.tier.actors]) == [True, True]
        # the store outlives the router actors (it is detached): with both gone, the response is still kept
        for actor in tier.tier.actors:
            ray.kill(actor, no_restart=True)
        store = ray.get_actor(f"raylm-responses-{port}")
        assert ray.get(store.get.remote(made.id)) is not None
