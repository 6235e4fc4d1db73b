"""Structured outputs over HTTP with the real openai client: response_format (json_object, json_schema,
and the client's parse with a pydantic model), vLLM's structured_outputs (json, regex, choice, grammar,
json_object, disable_any_whitespace) and its older guided_json, guided_regex, guided_choice and
guided_grammar, whole and streamed; Qwen3's reasoning split; chat_template_kwargs; bad schemas are
400s naming the field. Random weights never write valid JSON by themselves, so output that parses
and validates is the grammar's doing."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import httpx
import jsonschema
import pytest
from chat_fixtures import chat_checkpoint, no_whitespace
from fixtures import PROMPT_TEXTS
from helpers import client, serving
from pydantic import BaseModel, Field
from test_serve import check_replicas_whole

from cluster.model_info import load_tokenizer

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Describe a person."}]

SCHEMAS = {
    "required fields and an enum": {
        "type": "object",
        # a pattern bounds the string (xgrammar 0.2.9 lets control characters into a maxLength string,
        # which is no JSON)
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "number", "maximum": 1e3},
                },
                "required": ["x", "y"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["point", "ok"],
    },
    "an array with bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["tags", "scores"],
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen3_path):
    return chat_checkpoint(qwen3_path, tmp_path_factory.mktemp("structured") / "model")


@pytest.fixture(scope="module")
def srv(ray_cluster, model):
    with serving(model, num_pages=1024, max_running_reqs=16) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(str(model))


@pytest.fixture(scope="module")
def bias(tokenizer):
    return no_whitespace(tokenizer)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_output_under_a_json_schema_validates(srv, bias, name):
    schema = SCHEMAS[name]
    for seed in (1, 2):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=120,
            temperature=1,
            seed=seed,
            logit_bias=bias,
            response_format=json_schema_format(schema),
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice  # the grammar ended it, well before max_tokens
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_output_is_an_object(srv, bias):
    for prompt in PROMPT_TEXTS[:3]:
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0,
            logit_bias=bias,
            response_format={"type": "json_object"},
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


class Person(BaseModel):
    name: str = Field(pattern="^[a-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


def test_the_clients_parse_returns_the_pydantic_object(srv, bias):
    r = client(srv).chat.completions.parse(
        model="tiny", messages=MSG, max_tokens=120, temperature=0, logit_bias=bias, response_format=Person
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.role in ("admin", "user")


def test_a_streamed_constrained_chat_equals_the_whole_one(srv, bias):
    args = dict(
        model="tiny",
        messages=MSG,
        max_tokens=120,
        temperature=1,
        seed=7,
        logit_bias=bias,
        response_format=json_schema_format(SCHEMAS["nested objects"]),
    )
    whole = client(srv).chat.completions.create(**args)
    chunks = list(client(srv).chat.completions.create(**args, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"


def test_guided_json_constrains_a_completion(srv, bias):
    schema = SCHEMAS["required fields and an enum"]
    for guided in (schema, json.dumps(schema)):  # a schema, or its JSON text
        r = client(srv).completions.create(
            model="tiny",
            prompt=PROMPT_TEXTS[1],
            max_tokens=120,
            temperature=0,
            logit_bias=bias,
            extra_body={"guided_json": guided},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_guided_regex_and_grammar_outputs_match(srv):
    grammar = 'root ::= "(" num (("+" | "*") num){0,3} ")"\nnum ::= [1-9] [0-9]?'
    for field, value, pattern in (
        ("guided_regex", "[a-z]{2,5}-[0-9]{1,3}", "[a-z]{2,5}-[0-9]{1,3}"),
        ("guided_grammar", grammar, r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)"),
    ):
        r = client(srv).completions.create(
            model="tiny", prompt=PROMPT_TEXTS[3], max_tokens=40, temperature=1, seed=3, n=3, extra_body={field: value}
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), (field, choice.text)


def test_guided_choice_is_one_of_the_choices(srv):
    choices = ["yes", "no", "maybe 🌙", 'a "quoted" one']
    for seed, prompt in enumerate(PROMPT_TEXTS[:4]):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=20,
            temperature=1,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"


GRAMMAR = 'root ::= "(" num (("+" | "*") num){0,3} ")"\nnum ::= [1-9] [0-9]?'
STRUCTURED = [  # vLLM's structured_outputs: (its constraint, how to check an output)
    (
        {"json": SCHEMAS["required fields and an enum"]},
        lambda t: jsonschema.validate(json.loads(t), SCHEMAS["required fields and an enum"]),
    ),
    (
        {"json": json.dumps(SCHEMAS["nested objects"])},
        lambda t: jsonschema.validate(json.loads(t), SCHEMAS["nested objects"]),
    ),
    ({"regex": "[a-z]{2,5}-[0-9]{1,3}"}, lambda t: re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", t) or pytest.fail(t)),
    ({"choice": ["yes", "no", "maybe 🌙"]}, lambda t: t in ("yes", "no", "maybe 🌙") or pytest.fail(t)),
    ({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)", t) or pytest.fail(t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize(
    "outputs,check", STRUCTURED, ids=["json", "json-text", "regex", "choice", "grammar", "json_object"]
)
def test_structured_outputs_constrain_the_output(srv, bias, chat, outputs, check):
    args = dict(model="tiny", max_tokens=120, temperature=0, logit_bias=bias)
    extra = {"structured_outputs": outputs}
    c = client(srv)
    if chat:
        r = c.chat.completions.create(messages=MSG, extra_body=extra, **args)
        text = r.choices[0].message.content
    else:
        r = c.completions.create(prompt=MSG[0]["content"], extra_body=extra, **args)
        text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    check(text)


def test_disable_any_whitespace_writes_compact_json(srv):
    """No logit bias here: random weights left free fill JSON with whitespace; the grammar allows none."""
    schema = SCHEMAS["required fields and an enum"]
    for seed in (1, 2, 3):
        r = client(srv).chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=120,
            temperature=1,
            seed=seed,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        assert text == json.dumps(json.loads(text))  # xgrammar's one space after each ":" and ","


def test_constrained_requests_beside_free_ones_leave_those_unchanged(srv, bias):
    free = dict(model="tiny", prompt=PROMPT_TEXTS[6], max_tokens=24, temperature=0)
    alone = client(srv).completions.create(**free).choices[0].text
    results: dict[str, str] = {}

    def run(key: str, **kw) -> None:
        results[key] = client(srv).completions.create(**kw).choices[0].text

    threads = [threading.Thread(target=run, args=(f"free-{i}",), kwargs=free) for i in range(3)]
    threads += [
        threading.Thread(
            target=run,
            args=(f"json-{i}",),
            kwargs=dict(
                model="tiny",
                prompt=PROMPT_TEXTS[i],
                max_tokens=80,
                temperature=0,
                logit_bias=bias,
                extra_body={"guided_json": SCHEMAS["nested objects"]},
            ),
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[f"free-{i}"] for i in range(3)] == [alone] * 3
    check_replicas_whole(srv)


def _thinking(**extra) -> dict:
    """A chat request whose output is a think block of "abc", then "hello"."""
    body = {"guided_regex": "<think>abc</think>\n\nhello", **extra}
    return dict(model="tiny", messages=MSG, max_tokens=40, temperature=0, extra_body=body)


def test_reasoning_is_returned_apart_from_the_content(srv):
    body = _thinking()
    message = client(srv).chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "hello")
    chunks = list(client(srv).chat.completions.create(**body, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "abc"
    assert "".join(d.content or "" for d in deltas) == "hello"


def test_include_reasoning_false_parses_the_reasoning_out_and_leaves_it_out(srv):
    body = _thinking(include_reasoning=False)
    message = client(srv).chat.completions.create(**body).choices[0].message
    assert message.content == "hello" and getattr(message, "reasoning_content", None) is None
    assert "reasoning_content" not in message.model_dump(exclude_unset=True)
    deltas = [ch.choices[0].delta for ch in client(srv).chat.completions.create(**body, stream=True) if ch.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "hello"


def test_an_answer_without_thinking_has_no_reasoning(srv):
    message = (
        client(srv)
        .chat.completions.create(
            model="tiny", messages=MSG, max_tokens=12, temperature=0, extra_body={"guided_regex": "[a-z]{3,8}"}
        )
        .choices[0]
        .message
    )
    assert message.reasoning_content is None and re.fullmatch("[a-z]{3,8}", message.content)


def test_chat_template_kwargs_reach_the_template(srv, tokenizer):
    def ids(**kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids

    plain, no_thinking = ids(), ids(enable_thinking=False)
    assert len(no_thinking) > len(plain)  # the template writes an empty think block
    for kwargs, ids in ((None, plain), ({"enable_thinking": False}, no_thinking)):
        r = client(srv).chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
        assert r.usage.prompt_tokens == len(ids)


SCHEMA = SCHEMAS["nested objects"]
BAD = [  # (param, path, body): each a 400 whose param names the field
    ("response_format", CHAT, {"response_format": json_schema_format({"type": 5})}),
    ("response_format", CHAT, {"response_format": json_schema_format({"type": "objekt"})}),
    ("response_format", CHAT, {"response_format": json_schema_format({"$ref": "#/$defs/missing"})}),
    (
        "response_format",
        CHAT,
        {
            "response_format": json_schema_format(
                {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}
            )
        },
    ),
    ("response_format", CHAT, {"response_format": {"type": "json_schema"}}),  # no json_schema
    ("response_format.type", CHAT, {"response_format": {"type": "xml"}}),
    ("guided_json", C, {"guided_json": {"type": "objekt"}}),
    ("guided_json", C, {"guided_json": "{not json"}),
    ("guided_json", C, {"guided_json": ["a list"]}),
    ("guided_regex", C, {"guided_regex": "(a|b"}),
    ("guided_grammar", C, {"guided_grammar": 'rule ::= "a"'}),  # no root rule
    ("guided_choice", C, {"guided_choice": []}),
    ("guided_regex", CHAT, {"guided_json": SCHEMA, "guided_regex": "a+"}),  # two formats at once
    ("guided_json", CHAT, {"response_format": {"type": "json_object"}, "guided_json": SCHEMA}),
    ("chat_template_kwargs", CHAT, {"chat_template_kwargs": {"tokenize": True}}),
    ("structured_outputs.json", C, {"structured_outputs": {"json": {"type": "objekt"}}}),
    ("structured_outputs.json", CHAT, {"structured_outputs": {"json": "{not json"}}),
    ("structured_outputs.regex", C, {"structured_outputs": {"regex": "(a|b"}}),
    ("structured_outputs.grammar", C, {"structured_outputs": {"grammar": 'rule ::= "a"'}}),
    ("structured_outputs.choice", CHAT, {"structured_outputs": {"choice": []}}),
    ("structured_outputs.regex", C, {"structured_outputs": {"json": SCHEMA, "regex": "a+"}}),  # two at once
    ("structured_outputs.choice", CHAT, {"guided_json": SCHEMA, "structured_outputs": {"choice": ["a"]}}),
    (
        "structured_outputs.json",
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
    ),
    ("structured_outputs.structural_tag", C, {"structured_outputs": {"structural_tag": "{}"}}),
    ("structured_outputs.whitespace_pattern", C, {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}),
    (
        "structured_outputs.disable_any_whitespace",
        C,
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
    ),
    ("structured_outputs.jsn", CHAT, {"structured_outputs": {"jsn": SCHEMA}}),  # a misspelled key
    ("structured_outputs", C, {"structured_outputs": {}}),  # no constraint at all
    # a schema the grammar would not enforce whole (tests/test_json_schema_rewrite.py has the cases)
    ("response_format", CHAT, {"response_format": json_schema_format({"type": "number", "multipleOf": 0.5})}),
]


@pytest.mark.parametrize("param,path,body", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_format_is_a_400_naming_its_field(srv, param, path, body):
    base = {"model": "tiny", "max_tokens": 4, **({"messages": MSG} if path == CHAT else {"prompt": "Hello"})}
    r = httpx.post(srv.url + path, json={**base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err


def test_a_text_response_format_is_free_text(srv):
    r = httpx.post(
        srv.url + CHAT,
        json={
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 4,
            "ignore_eos": True,
            "response_format": {"type": "text"},
        },
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_json_is_compact_by_default_and_free_whitespace_is_an_opt_in(srv):
    """No logit bias: random weights left free fill JSON with whitespace. By default the grammar allows
    none (json.dumps's form); `disable_any_whitespace: false`, in structured_outputs or as an extension
    field of response_format, lets it in."""
    schema = SCHEMAS["required fields and an enum"]
    fmt = json_schema_format(schema)

    def texts(**kw) -> list[tuple[str, str]]:
        out = []
        for seed in (1, 2, 3):
            r = client(srv).chat.completions.create(
                model="tiny", messages=MSG, max_tokens=120, temperature=1, seed=seed, **kw
            )
            out.append((r.choices[0].finish_reason, r.choices[0].message.content))
        return out

    for reason, text in texts(response_format=fmt):
        assert reason == "stop" and text == json.dumps(json.loads(text)), text
    for kw in (
        {"response_format": {**fmt, "disable_any_whitespace": False}},
        {"extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": False}}},
    ):
        free = texts(**kw)
        assert any(reason == "length" or text != json.dumps(json.loads(text)) for reason, text in free), free
