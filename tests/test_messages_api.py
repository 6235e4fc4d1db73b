"""Anthropic's Messages API with the real anthropic client (messages.create, .stream, count_tokens): it
serves the chat request it translates into (the same prompt, greedy output, tools and reasoning
parser), whole and as Anthropic's event sequence, with its stop reasons; errors in Anthropic's shape
naming the field; the API key in x-api-key."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest
from chat_fixtures import OPENS_THINKING_TEMPLATE, chat_checkpoint, no_whitespace
from helpers import serving
from test_serve import check_replicas_whole

from cluster.model_info import load_tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOL = {"name": "get_weather", "description": "the forecast", "input_schema": WEATHER}
NO_THINKING_CHAT = {"chat_template_kwargs": {"enable_thinking": False}}
KEY = "secret-key"
# this client has no temperature argument: sent as the API defines it
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen3_path):
    return chat_checkpoint(qwen3_path, tmp_path_factory.mktemp("messages") / "qwen", OPENS_THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def srv(ray_cluster, model):
    with serving(model, num_pages=1024, max_running_reqs=16, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def bias(model):
    return no_whitespace(load_tokenizer(str(model)))


def claude(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def chat(srv, messages, **kw):
    import openai

    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    return c.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def event_types(events) -> list[str]:
    out: list[str] = []
    for e in events:
        name = e.type if e.type != "content_block_delta" else f"delta:{e.delta.type}"
        if not (out and out[-1] == name and name.startswith("delta:")):
            out.append(name)
    return out


def test_a_message_is_answered_as_the_chat_request_it_means(srv):
    m = claude(srv).messages.create(
        model="tiny",
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    c = chat(
        srv,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body=NO_THINKING_CHAT,
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    # Anthropic counts the prompt as the tokens computed plus those read from the prefix cache
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if c.choices[0].finish_reason == "length" else "end_turn")


def test_a_tool_name_of_up_to_128_characters_is_served_and_a_longer_one_is_named_as_sent(srv):
    """Anthropic's names are ^[a-zA-Z0-9_-]{1,128}$: the chat request they are served as once stopped at 64."""
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    long = {**TOOL, "name": "t" * 128}
    r = httpx.post(srv.url + "/v1/messages", json={**body, "tools": [long]}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200, r.text
    too_long = {**TOOL, "name": "t" * 129}
    r = httpx.post(srv.url + "/v1/messages", json={**body, "tools": [too_long]}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools.0.name"), r.text


def test_count_tokens_is_the_prompt_a_message_runs(srv):
    body = dict(model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    counted = claude(srv).messages.count_tokens(**body)
    m = claude(srv).messages.create(**body, max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("system", [[], ""])
def test_an_empty_system_prompt_is_none(srv, system):
    messages = [{"role": "user", "content": "Hello"}]
    bare = claude(srv).messages.count_tokens(model="tiny", messages=messages)
    assert claude(srv).messages.count_tokens(model="tiny", messages=messages, system=system) == bare


def test_tool_use_and_tool_result_blocks_are_the_conversation_the_template_renders(srv):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 1}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    counted = claude(srv).messages.count_tokens(model="tiny", messages=messages, tools=[TOOL])
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    chat_tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER},
    }
    c = chat(
        srv,
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        ],
        tools=[chat_tool],
        max_tokens=1,
        extra_body=NO_THINKING_CHAT,
    )
    assert counted.input_tokens == c.usage.prompt_tokens


def test_the_stream_is_anthropics_event_sequence_adding_up_to_the_whole(srv):
    body = dict(model="tiny", messages=[{"role": "user", "content": "A story"}], max_tokens=6, extra_body=GREEDY)
    whole = claude(srv).messages.create(**body)
    with claude(srv).messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
        text = stream.get_final_text()
    raw = [
        e
        for e in events
        if e.type
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert event_types(raw) == [
        "message_start",
        "content_block_start",
        "delta:text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt


def test_thinking_is_returned_as_thinking_blocks(srv):
    # the template opens the think block: random weights think on until max_tokens
    body = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Think"}],
        max_tokens=8,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    m = claude(srv).messages.create(**body)
    c = chat(srv, [{"role": "user", "content": "Think"}], max_tokens=8)
    assert m.content[0].type == "thinking" and m.content[0].thinking == c.choices[0].message.reasoning_content
    with claude(srv).messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "delta:thinking_delta" in event_types(events)
    assert final.content[0].thinking == m.content[0].thinking
    # adaptive: the model decides how long it thinks, as this one does once thinking is on
    adaptive = claude(srv).messages.create(**{**body, "thinking": {"type": "adaptive"}})
    assert adaptive.content[0].type == "thinking" and adaptive.content[0].thinking == m.content[0].thinking


def test_tool_choice_tool_makes_a_tool_use_block_whose_input_validates(srv, bias):
    # logit_bias (the chat API's) keeps random weights from filling the JSON with whitespace
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        body = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[TOOL],
            tool_choice=choice,
            max_tokens=150,
            extra_body={**GREEDY, "logit_bias": bias},
        )
        m = claude(srv).messages.create(**body)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m.content
        assert uses[0].id.startswith("toolu_")  # Anthropic's prefix
        jsonschema.validate(uses[0].input, WEATHER)
        with claude(srv).messages.stream(**body) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", uses[0].name, uses[0].input)]
        assert final.content[0].id.startswith("toolu_")
        assert "delta:input_json_delta" in event_types(events) and final.stop_reason == "tool_use"


def test_a_stop_sequence_is_the_stop_reason_with_the_sequence(srv):
    body = dict(model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=12, extra_body=GREEDY)
    free = claude(srv).messages.create(**body)
    text = free.content[0].text
    if len(text) < 4:
        pytest.skip("the model's text is too short to cut")
    stop = text[2:4]
    m = claude(srv).messages.create(**body, stop_sequences=["zzzz-never", stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[: text.find(stop)]
    with claude(srv).messages.stream(**body, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def _result(tool_use_id: str, content) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}


@pytest.mark.parametrize(
    "fields, where",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"system": [{"type": "text"}]}, "system.0: a text block needs its text"),
        ({"messages": [{"role": "assistant", "content": ""}]}, "messages: a final assistant message with empty"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools.0.type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"temperature": 3}, "temperature"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"messages": [_USE, {"role": "user", "content": [_result("t1", None)]}]}, "messages.1.content.0.content"),
        ({"messages": [_USE, {"role": "user", "content": [_result("t1", 5)]}]}, "messages.1.content.0.content"),
        ({"messages": [_USE, {"role": "user", "content": [_result("t1", ["x"])]}]}, "messages.1.content.0.content.0"),
        ({"messages": [{"role": "user", "content": [_result("t1", "x")]}]}, "messages.0.content.0.tool_use_id"),
        ({"messages": [_USE, {"role": "user", "content": [_result("t2", "x")]}]}, "messages.1.content.0.tool_use_id"),
        ({"messages": [{**_USE, "content": [{**_USE["content"][0], "id": None}]}]}, "messages.0.content.0"),
        ({"messages": [{**_USE, "content": [{**_USE["content"][0], "id": ""}]}]}, "messages.0.content.0"),
        ({"messages": [_USE, {"role": "user", "content": [_result("", "x")]}]}, "messages.1.content.0"),
        # the chat API's fields this API has not: refused, never ignored (with this API's own where it has one)
        ({"stop": ["x"]}, "stop: stop is the chat API's"),  # named as sent, this API's own field after it
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"n": 2}, "n is the chat API's"),
        ({"max_completion_tokens": 3}, "max_completion_tokens: "),
        ({"tools": [{**TOOL, "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ],
)
def test_bad_input_is_an_anthropic_error_naming_the_field(srv, fields, where):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert where in error["error"]["message"]


def test_the_chat_apis_fields_at_their_defaults_are_accepted_and_a_seed_repeats_a_sampled_answer(srv):
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 1}
    defaults = {"n": 1, "frequency_penalty": 0.0, "stop": [], "logprobs": False}

    def text(seed: int) -> str:
        r = httpx.post(
            srv.url + "/v1/messages", json={**body, **defaults, "seed": seed}, headers={"x-api-key": KEY}, timeout=60
        )
        assert r.status_code == 200, r.text
        return "".join(block["text"] for block in r.json()["content"] if block["type"] == "text")

    first = text(7)
    assert text(7) == first
    assert any(text(seed) != first for seed in (8, 9, 10))


def test_the_anthropic_client_lists_and_retrieves_the_served_model(srv):
    (info,) = claude(srv).models.list().data
    assert info.id == "tiny" and info.type == "model" and info.display_name == "tiny"
    assert info.created_at.year >= 2026  # a datetime it parsed
    assert claude(srv).models.retrieve("tiny").id == "tiny"


def test_the_client_raises_its_own_errors(srv):
    with pytest.raises(anthropic.NotFoundError):
        claude(srv).messages.create(model="claude-none", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_count_tokens_names_a_bad_tool_result_in_anthropics_shape(srv):
    body = {"model": "tiny", "messages": [_USE, {"role": "user", "content": [_result("t1", None)]}]}
    r = httpx.post(srv.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "messages.1.content.0.content" in r.json()["error"]["message"]


def test_a_wrong_stop_sequences_type_is_named_as_sent(srv):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "END"}
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop_sequences:"), r.text


@pytest.mark.parametrize("method, path", [("GET", "/v1/messages"), ("PUT", "/v1/messages"), ("POST", "/v1/messages/x")])
def test_a_wrong_method_or_path_under_messages_is_an_anthropic_error(srv, method, path):
    r = httpx.request(method, srv.url + path, json={}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code in (404, 405) and r.json()["type"] == "error", r.text
    # Anthropic's type for each 4xx it has no other for
    assert r.json()["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")


def test_a_final_assistant_message_is_the_text_the_answer_continues(srv, model):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One two"}]
    m = claude(srv).messages.create(model="tiny", messages=messages, max_tokens=6, extra_body=GREEDY)
    continued = {**NO_THINKING_CHAT, "add_generation_prompt": False, "continue_final_message": True}
    c = chat(srv, messages, max_tokens=6, extra_body=continued)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.content[0].text == c.choices[0].message.content
    tokenizer = load_tokenizer(str(model))
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False, enable_thinking=False)
    assert text.endswith("One two")
    counted = claude(srv).messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert counted == len(tokenizer(text, add_special_tokens=False).input_ids)
    # an empty final assistant turn prefills nothing: the answer is a new turn's
    empty = claude(srv).messages.count_tokens(
        model="tiny", messages=[*messages[:1], {"role": "assistant", "content": ""}]
    )
    assert empty.input_tokens == claude(srv).messages.count_tokens(model="tiny", messages=messages[:1]).input_tokens


@pytest.mark.parametrize(
    "content",
    [
        "One two ",
        [{"type": "text", "text": "One"}, {"type": "text", "text": " two\n"}],
        [{"type": "text", "text": "One two"}, {"type": "text", "text": ""}],  # joined by a newline
    ],
)
def test_a_final_assistant_message_ending_in_whitespace_is_refused_as_anthropic_does(srv, content):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": content}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": "tiny", "max_tokens": 4, "messages": messages}
        r = httpx.post(srv.url + path, json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["message"].startswith("messages.1.content: final assistant content cannot end")


def test_an_error_tool_result_says_so_in_the_prompt(srv):
    def count(**result) -> int:
        user = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", **result}]}
        return claude(srv).messages.count_tokens(model="tiny", messages=[_USE, user]).input_tokens

    assert count(content="failed", is_error=True) == count(content="Error: failed")
    assert count(content="failed", is_error=True) > count(content="failed")


def test_a_streamed_message_reports_the_prefix_cache_as_the_whole_message_does(srv):
    body = dict(model="tiny", system="Streamed twice.", messages=[{"role": "user", "content": "A longer prompt here"}])
    claude(srv).messages.create(**body, max_tokens=2)
    whole = claude(srv).messages.create(**body, max_tokens=2)
    with claude(srv).messages.stream(**body, max_tokens=2) as stream:
        final = stream.get_final_message()
    assert whole.usage.cache_read_input_tokens > 0
    assert final.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_replicas_are_whole_after_the_messages(srv):
    check_replicas_whole(srv)


def test_a_prompt_served_again_reads_the_prefix_cache_and_counts_it_apart(srv):
    body = dict(model="tiny", system="Cached twice.", messages=[{"role": "user", "content": "A prompt of some length"}])
    first = claude(srv).messages.create(**body, max_tokens=2)
    again = claude(srv).messages.create(**body, max_tokens=2)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.usage.cache_read_input_tokens > 0
