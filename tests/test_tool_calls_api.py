"""Tools over HTTP with the real openai client: the chat template renders tools, tool calls and tool
results; tool_choice "required" or a named function makes the output a call (in the Qwen format, and in
Llama 3.1's JSON on a Llama model) whose arguments validate against the function's schema, read back
into tool_calls whole and as stream deltas; "auto" and "none" leave random weights to plain text; bad
tools and choices are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from chat_fixtures import chat_checkpoint, no_whitespace
from helpers import client, serving
from test_serve import check_replicas_whole

from cluster.model_info import load_tokenizer

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory, qwen3_path):
    return chat_checkpoint(qwen3_path, tmp_path_factory.mktemp("tools") / "qwen")


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen_model):
    with serving(qwen_model, num_pages=1024, max_running_reqs=16) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen_model):
    return load_tokenizer(str(qwen_model))


@pytest.fixture(scope="module")
def bias(tokenizer):
    return no_whitespace(tokenizer)


def check_calls(calls) -> None:
    """Every call names a listed function, with arguments that validate against its parameters."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_required_makes_a_call_whose_arguments_validate(srv, bias):
    for seed in (1, 2):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=MSG,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=150,
            temperature=1,
            seed=seed,
            logit_bias=bias,
            extra_body=NO_THINKING,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)


def test_required_with_parallel_calls_ends_after_the_last_call(srv, bias):
    """Parallel calls allowed: one call or more, one after another, and the output ends after the last
    (no text after it), with finish_reason tool_calls."""
    for seed in (1, 2, 3):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=MSG,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            temperature=1,
            seed=seed,
            logit_bias=bias,
            extra_body=NO_THINKING,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(srv, bias):
    for name in ("get_weather", "get_time"):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=MSG,
            tools=TOOLS,
            max_tokens=150,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": name}},
            logit_bias=bias,
            extra_body=NO_THINKING,
        )
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == [name] and r.choices[0].finish_reason == "tool_calls"
        check_calls(calls)


# parameters as pydantic writes a recursive model (a reference at the top) and as clients often write
# them (no type: an object here, as OpenAI reads it)
TREE = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            "required": ["v"],
        }
    },
    "$ref": "#/$defs/Node",
}
UNTYPED = {"properties": {"note": {"enum": ["a", "b"]}}, "required": ["note"]}


@pytest.mark.parametrize("params", [TREE, UNTYPED, {}], ids=["top-reference", "no-type", "empty"])
def test_parameters_given_as_a_reference_or_without_a_type_are_an_object_a_forced_call_fills(srv, bias, params):
    r = client(srv).chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
        logit_bias=bias,
        extra_body=NO_THINKING,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    assert isinstance(arguments, dict)
    jsonschema.validate(arguments, params)


def test_a_thinking_model_may_think_before_a_required_call(srv, bias):
    # without enable_thinking false the grammar lets a think block come first, and the output's start
    # is read as reasoning
    r = client(srv).chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        logit_bias=bias,
    )
    choice = r.choices[0]
    if choice.finish_reason == "length":  # random weights, once thinking, think on until max_tokens
        assert choice.message.reasoning_content and choice.message.content is None
    else:
        check_calls(choice.message.tool_calls)


def test_streamed_calls_are_deltas_that_add_up_to_the_whole_message(srv, bias):
    args = dict(
        model="tiny",
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        temperature=1,
        seed=5,
        logit_bias=bias,
        extra_body=NO_THINKING,
    )
    whole = client(srv).chat.completions.create(**args).choices[0]
    chunks = list(client(srv).chat.completions.create(**args, stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def prompt_ids(tokenizer, messages, tools=None, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_without_a_forced_call_random_weights_write_text_and_the_tools_are_rendered(srv, tokenizer, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    r = client(srv).chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, max_tokens=8, temperature=0, **extra
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(prompt_ids(tokenizer, MSG, TOOLS)) > len(prompt_ids(tokenizer, MSG))


def test_a_strict_function_under_auto_serves_with_its_grammar_and_text_stays_free(srv, bias):
    """Random weights open no call: the grammar (text free until a call opens) lets them write text,
    streamed and whole alike."""
    args = dict(
        model="tiny",
        messages=MSG,
        tools=STRICT,
        max_tokens=12,
        temperature=1,
        seed=3,
        logit_bias=bias,
        extra_body=NO_THINKING,
    )
    whole = client(srv).chat.completions.create(**args).choices[0]
    assert whole.message.tool_calls is None and whole.message.content and whole.finish_reason in ("stop", "length")
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in client(srv).chat.completions.create(**args, stream=True)
    )
    assert streamed == whole.message.content
    check_replicas_whole(srv)


def test_strict_reaches_the_chat_path_from_the_messages_and_responses_apis(srv):
    """Their tools' `strict` means what chat's does: the refusals above, named as each API names the field."""
    tool = {"name": "f", "input_schema": NOT_ENFORCED, "strict": True}
    r = httpx.post(
        srv.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": MSG, "tools": [tool]},
        timeout=30,
    )
    # Anthropic's error body has no param: the message names the field
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools.0.input_schema:"), r.text
    tool = {"type": "function", "name": "f", "parameters": TIME, "strict": True}
    r = httpx.post(
        srv.url + "/v1/responses",
        json={"model": "tiny", "input": "hi", "tools": [tool], "text": {"format": {"type": "json_object"}}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.strict", r.text


def test_a_forced_call_cut_by_the_token_limit_leaves_no_markup_in_responses_and_messages(srv):
    """Chat returns what the model wrote (vLLM's choice); the Responses and Messages APIs have no item for
    half a call, and an agent would store its markup as the assistant's words."""
    tool = {"type": "function", "name": "get_time", "parameters": TIME}
    r = httpx.post(
        srv.url + "/v1/responses",
        json={"model": "tiny", "input": "hi", "tools": [tool], "tool_choice": "required", "max_output_tokens": 12},
        timeout=30,
    )
    body = r.json()
    assert r.status_code == 200 and body["status"] == "incomplete", r.text
    texts = [part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]]
    assert not [item for item in body["output"] if item["type"] == "function_call"] and "<tool_call>" not in "".join(
        texts
    )
    r = httpx.post(
        srv.url + "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 12,
            "messages": MSG,
            "tools": [{"name": "get_time", "input_schema": TIME}],
            "tool_choice": {"type": "any"},
        },
        timeout=30,
    )
    body = r.json()
    assert r.status_code == 200 and body["stop_reason"] == "max_tokens", r.text
    assert "<tool_call>" not in "".join(block.get("text", "") for block in body["content"])


def test_a_tools_schema_keywords_no_grammar_enforces_are_served_under_auto(srv):
    """Under "auto" a tool's parameters are rendered for the model to read, not enforced: a keyword that a
    grammar would not enforce (uniqueItems) is no error there; forced, it is (tests/test_api_bounds.py)."""
    tags = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    tool = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    r = httpx.post(
        srv.url + CHAT, json={"model": "tiny", "messages": MSG, "tools": [tool], "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text


def test_tokenize_counts_the_tools_and_template_kwargs_as_chat_does(srv):
    r = client(srv).chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, max_tokens=1, extra_body=NO_THINKING
    )
    counted = httpx.post(srv.url + "/tokenize", json={"messages": MSG, "tools": TOOLS, **NO_THINKING}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == r.usage.prompt_tokens


def test_calls_and_tool_results_sent_back_are_rendered_by_the_template(srv, tokenizer):
    sent = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    rendered = [
        *MSG,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client(srv).chat.completions.create(model="tiny", messages=sent, tools=TOOLS, max_tokens=2)
    assert r.usage.prompt_tokens == len(prompt_ids(tokenizer, rendered, TOOLS))
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris", "days": 2}' in text and "sunny, 21 C" in text
    check_replicas_whole(srv)


# a schema the grammar cannot enforce (xgrammar compiles `not` without enforcing it)
NOT_ENFORCED = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]

BAD = [  # (param, body): each a 400 whose param names the field
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}),
    (
        "tools",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                    },
                }
            ]
        },
    ),
    ("tools", {"tools": [TOOLS[0], TOOLS[0]]}),  # one name twice
    ("tools.0.function.name", {"tools": [{"type": "function", "function": {"name": "has space"}}]}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}),
    ("tool_choice", {"tool_choice": "required"}),  # no tools
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "always"}),
    ("messages.1", {"messages": [*MSG, {"role": "tool", "content": "sunny"}]}),  # no tool_call_id
    ("functions", {"functions": [{"name": "f"}]}),  # the deprecated form stays refused
    # a function's arguments are an object: another schema is refused, not a call the parser cannot read
    (
        "tools.0.function.parameters",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
    ),
    (
        "tools.0.function.parameters",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "string"}]}}}]},
    ),
    # a forced call's arguments follow a schema the grammar cannot enforce: refused
    (
        "tools",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://x.org/s.json"}}}],
            "tool_choice": "required",
        },
    ),
    # a strict function's calls follow its schema by a grammar under auto too: the same refusal
    (
        "tools.1.function.parameters",
        {
            "tools": [
                TOOLS[0],
                {"type": "function", "function": {"name": "f", "parameters": NOT_ENFORCED, "strict": True}},
            ]
        },
    ),
    # and a client's format, which constrains the whole output, leaves no room for its calls
    ("tools.0.function.strict", {"tools": STRICT, "response_format": {"type": "json_object"}}),
]


@pytest.mark.parametrize("param,body", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tools_and_choices_are_400s_naming_the_field(srv, param, body):
    r = httpx.post(srv.url + CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and param.split(".")[0] in err["message"], err


@pytest.fixture(scope="module")
def llama_srv(ray_cluster, tmp_path_factory, llama_path):
    model = chat_checkpoint(llama_path, tmp_path_factory.mktemp("tools") / "llama")
    with serving(model, num_pages=512, max_running_reqs=8) as server:
        yield server


def test_a_llama_model_calls_in_its_json_form_and_has_no_reasoning(llama_srv):
    c = client(llama_srv)
    r = c.chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
        logit_bias=no_whitespace(load_tokenizer(llama_srv.config.model)),
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls)
    text = (
        c.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=40,
            temperature=0,
            extra_body={"guided_regex": "<think>abc</think>hello"},
        )
        .choices[0]
        .message
    )
    assert text.content == "<think>abc</think>hello" and getattr(text, "reasoning_content", None) is None


def test_four_constrained_chats_at_once_each_keep_their_grammar(srv, bias):
    """Four forced calls and schema-constrained answers decoding in the same steps (mixed, joined and
    left at different steps): each ends as its grammar allows, a call or JSON that validates, never
    `stop` on broken text."""
    from concurrent.futures import ThreadPoolExecutor

    answer = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}

    def one(seed: int):
        kw = dict(model="tiny", messages=MSG, max_tokens=150, temperature=1, seed=seed, logit_bias=bias)
        if seed % 2:
            kw.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING)
        else:
            kw.update(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
        return seed, client(srv).chat.completions.create(**kw).choices[0]

    with ThreadPoolExecutor(4) as pool:
        for seed, choice in pool.map(one, range(16)):
            if seed % 2:
                assert choice.finish_reason == "tool_calls", choice
                check_calls(choice.message.tool_calls)
            elif choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), answer)
    check_replicas_whole(srv)


@pytest.fixture(scope="module")
def plain_srv(ray_cluster, qwen3_path):
    """The tiny model with its own template, which renders neither tools nor an assistant turn's calls."""
    with serving(qwen3_path, num_pages=256, max_running_reqs=4) as server:
        yield server


CALLED = [
    *MSG,
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tools_a_template_does_not_render_are_a_400_under_auto(plain_srv, qwen3_path):
    """Under "auto" the model could not choose calls it never sees: a 400 naming the tools, as documents a
    template does not render are. "none" (no call) and a forced call (a grammar writes it, of the schema)
    are served, and /tokenize counts the prompt the model would see."""
    plain = load_tokenizer(str(qwen3_path))
    assert plain.apply_chat_template(MSG, tools=TOOLS, tokenize=False) == plain.apply_chat_template(MSG, tokenize=False)
    for choice in ("auto", None):
        extra = {} if choice is None else {"tool_choice": choice}
        r = httpx.post(
            plain_srv.url + CHAT,
            json={"model": "tiny", "messages": MSG, "tools": TOOLS, "max_tokens": 4, **extra},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "does not render tools" in r.json()["error"]["message"]
    none = client(plain_srv).chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    counted = httpx.post(plain_srv.url + "/tokenize", json={"messages": MSG, "tools": TOOLS}, timeout=30)
    assert counted.status_code == 200 and counted.json()["count"] == none.usage.prompt_tokens, counted.text
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client(plain_srv).chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=TOOLS,
        tool_choice=forced,
        max_tokens=150,
        temperature=0,
        logit_bias=no_whitespace(plain),
        extra_body=NO_THINKING,
    )
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_calls_a_template_does_not_render_are_written_into_their_turn_as_the_model_writes_calls(plain_srv, qwen3_path):
    """An assistant turn's calls that the template would leave out are written after its text in the served
    model's own call format (Qwen's tags here), which the server reads back from its output."""
    plain = load_tokenizer(str(qwen3_path))
    assert plain.apply_chat_template(CALLED, tokenize=False) == plain.apply_chat_template(
        [{k: v for k, v in m.items() if k != "tool_calls"} for m in CALLED], tokenize=False
    )
    written = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    want = plain.apply_chat_template(
        [*MSG, {"role": "assistant", "content": written}, CALLED[2]], add_generation_prompt=True, tokenize=False
    )
    r = client(plain_srv).chat.completions.create(
        model="tiny", messages=CALLED, max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert r.prompt_token_ids == plain(want, add_special_tokens=False).input_ids
    counted = httpx.post(plain_srv.url + "/tokenize", json={"messages": CALLED}, timeout=30).json()
    assert counted["tokens"] == r.prompt_token_ids


@pytest.mark.parametrize(
    "messages, where",
    [
        ([*MSG, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages.1.tool_call_id"),
        ([*CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "rain"}], "messages.3.tool_call_id"),
    ],
)
def test_a_tool_result_answering_no_call_before_it_is_a_400_naming_it(srv, messages, where):
    """As OpenAI's: the Responses and Messages APIs refuse such a result, and chat now does too."""
    r = httpx.post(srv.url + CHAT, json={"model": "tiny", "messages": messages, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text


def test_written_calls_leave_the_other_checks_as_they_were(plain_srv):
    """With an earlier turn's calls written into its text: documents the template does not render are still
    a 400, and arguments nested past Python's parser's depth are written as a string (not a server error)."""
    r = httpx.post(
        plain_srv.url + CHAT,
        json={"model": "tiny", "messages": CALLED, "documents": [{"title": "a", "text": "b"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    deep = [dict(m) for m in CALLED]
    deep[1] = {
        **CALLED[1],
        "tool_calls": [{**CALLED[1]["tool_calls"][0], "function": {"name": "f", "arguments": "[" * 5000}}],
    }
    r = httpx.post(plain_srv.url + CHAT, json={"model": "tiny", "messages": deep, "max_tokens": 2}, timeout=60)
    # rendered: then longer than the tiny model's context, which is the 400's reason
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def _counting_state(tokenizer):
    """A RouterState over `tokenizer` whose chat template renders are counted (state.renders)."""
    from types import SimpleNamespace

    from router.http.state import RouterState

    state = RouterState(config=SimpleNamespace(), tokenizer=tokenizer, model_name="m", max_seq_len=4096, vocab_size=8)
    state.renders = 0
    render = tokenizer.apply_chat_template

    def counted(*args, **kwargs):
        state.renders += 1
        return render(*args, **kwargs)

    state.tokenizer = SimpleNamespace(apply_chat_template=counted, chat_template=tokenizer.chat_template)
    return state


def test_a_part_the_template_was_seen_to_render_is_not_checked_again(tokenizer, qwen3_path):
    """A template that renders tools and calls: the first such request renders with and without each (3
    renders), later ones once, the same prompt; under other chat_template_kwargs the checks run again. A
    template seen not to render tools is checked, and refused, every time."""
    from router.http.errors import APIError
    from router.http.protocol import ChatCompletionRequest

    state = _counting_state(tokenizer)
    req = ChatCompletionRequest(model="m", messages=CALLED, tools=TOOLS)
    tools = TOOLS
    first = state.chat_prompt(req, tools, tools_seen=True)
    assert state.renders == 3
    assert state.chat_prompt(req, tools, tools_seen=True) == first and state.renders == 4
    other = ChatCompletionRequest(
        model="m", messages=CALLED, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
    )
    state.chat_prompt(other, tools, tools_seen=True)
    assert state.renders == 7

    plain = _counting_state(load_tokenizer(str(qwen3_path)))
    for _ in range(2):
        with pytest.raises(APIError, match="does not render tools"):
            plain.chat_prompt(ChatCompletionRequest(model="m", messages=MSG, tools=TOOLS), tools, tools_seen=True)


def test_calls_a_template_renders_only_in_a_turn_without_text_are_checked_for_a_turn_with_text(tokenizer):
    """DeepSeek's template renders a turn's calls only where the turn has no text: that a request's calls were
    rendered says nothing of a later request whose calling turn has text."""
    import copy

    from router.http.errors import APIError
    from router.http.protocol import ChatCompletionRequest

    deepseek_like = copy.deepcopy(tokenizer)
    deepseek_like.chat_template = (
        "{% for m in messages %}{{ m.role }}: {% if m.tool_calls and not m.content %}"
        "{% for c in m.tool_calls %}CALL {{ c.function.name }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
        "{% endfor %}"
    )
    state = _counting_state(deepseek_like)
    bare = [CALLED[0], {**CALLED[1], "content": None}, CALLED[2]]
    assert "CALL get_weather" in state.chat_prompt(ChatCompletionRequest(model="m", messages=bare))
    with pytest.raises(APIError, match=r"messages\.1\.tool_calls: this model's chat template does not render"):
        state.chat_prompt(ChatCompletionRequest(model="m", messages=CALLED))
