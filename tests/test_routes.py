"""The routes beside completions that clients call: a model's card, tokenize and detokenize (vLLM's and
SGLang's shapes), the version."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import serving

from cluster.model_info import load_tokenizer

KEY = "sk-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=256, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def test_the_openai_client_retrieves_the_served_model(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_tokenize_a_prompt_equals_the_tokenizer(srv, tokenizer):
    r = httpx.post(srv.url + "/tokenize", json={"model": "tiny", "prompt": "Hello there"}, headers=AUTH)
    assert r.status_code == 200, r.text
    ids = tokenizer("Hello there").input_ids
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and r.json()["max_model_len"] > 0


def test_tokenize_messages_applies_the_chat_template(srv, tokenizer):
    r = httpx.post(srv.url + "/tokenize", json={"messages": MSG}, headers=AUTH)
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids


def test_a_messages_text_parts_are_rendered_a_line_apart_as_vllm_joins_them(srv, tokenizer):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": parts}]}, headers=AUTH)
    assert r.status_code == 200, r.text
    joined = [{"role": "user", "content": "Hello\nworld"}]
    text = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids


def test_a_developer_message_is_the_system_turn_of_a_template_without_the_role(srv, tokenizer):
    assert "developer" not in tokenizer.chat_template  # the tests' template, as Qwen's and Llama's

    def tokens(role: str) -> list[int]:
        messages = [{"role": role, "content": "Answer in French."}, *MSG]
        r = httpx.post(srv.url + "/tokenize", json={"messages": messages}, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens("developer") == tokens("system")
    assert "Answer in French." in tokenizer.decode(tokens("developer"))


def test_detokenize_inverts_tokenize(srv):
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello there"}, headers=AUTH).json()["tokens"]
    r = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, headers=AUTH)
    assert r.status_code == 200 and "Hello there" in r.json()["prompt"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": MSG}, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
        ),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_tokenize_requests_get_openai_errors(srv, path, body, param):
    r = httpx.post(srv.url + path, json=body, headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"] and r.json()["error"]["param"] == param


def test_tokenize_needs_the_api_key_and_version_does_not(srv):
    assert httpx.post(srv.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    r = httpx.get(srv.url + "/version")
    assert r.status_code == 200 and r.json()["version"]
