"""vLLM's request fields over HTTP with the real openai client, as vLLM defines them: prompt_logprobs,
truncate_prompt_tokens, return_token_ids, return_tokens_as_token_ids, stream_options'
continuous_usage_stats and skip_special_tokens; fields that would change what a request means and are
not supported are 400s naming them, and at their neutral values are accepted."""

from __future__ import annotations

import httpx
import pytest
from fixtures import PROMPT_TEXTS, hf_prompt_logprobs
from helpers import client, serving

from cluster.model_info import load_tokenizer

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": PROMPT_TEXTS[2]}]
FREE = {"ignore_eos": True}


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=1024, max_running_reqs=16) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_prompt_logprobs_are_each_prompt_tokens_as_vllm_writes_them(srv, tokenizer, qwen3_path):
    ids = tokenizer(PROMPT_TEXTS[6]).input_ids
    r = client(srv).completions.create(
        model="tiny",
        prompt=PROMPT_TEXTS[6],
        max_tokens=2,
        temperature=1,
        seed=2,
        n=2,
        extra_body={"prompt_logprobs": 3},
    )
    expected = hf_prompt_logprobs(qwen3_path, ids)
    for choice in r.choices:
        scored = choice.prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None  # nothing comes before the first token
        for position, (token, entry) in enumerate(zip(ids[1:], scored[1:])):
            row = expected[position]
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
            assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
            top = sorted((v for k, v in entry.items()), key=lambda v: -v["logprob"])
            assert 3 <= len(entry) <= 4  # the token itself and the 3 most likely
            ranked = [v for v in top if v["rank"] is not None and v["rank"] <= 3]
            assert [v["rank"] for v in ranked] == [1, 2, 3]
            assert ranked[0]["logprob"] == pytest.approx(row.max().item(), abs=1e-3)


def test_chat_prompt_logprobs_are_on_the_response(srv, tokenizer):
    r = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=2, extra_body={"prompt_logprobs": 0, "return_token_ids": True}
    )
    ids = chat_ids(tokenizer, MSG)
    assert r.prompt_token_ids == ids and len(r.prompt_logprobs) == len(ids) and r.prompt_logprobs[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(r.prompt_logprobs[1:], ids[1:]))


def test_truncate_prompt_tokens_keeps_the_last_k(srv, tokenizer):
    ids = tokenizer(PROMPT_TEXTS[8]).input_ids
    args = dict(model="tiny", max_tokens=5, temperature=0, extra_body=FREE)
    kept = client(srv).completions.create(prompt=ids[-4:], **args)
    r = client(srv).completions.create(
        prompt=PROMPT_TEXTS[8], **{**args, "extra_body": {**FREE, "truncate_prompt_tokens": 4}}
    )
    assert r.usage.prompt_tokens == 4 and r.choices[0].text == kept.choices[0].text
    whole = client(srv).completions.create(prompt=ids, **{**args, "extra_body": {**FREE, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=2, extra_body={"truncate_prompt_tokens": 3}
    )
    assert chat.usage.prompt_tokens == 3


def test_truncate_prompt_tokens_minus_one_fits_a_prompt_past_the_context_with_room_for_max_tokens(srv):
    """-1 cuts a prompt longer than the context to what leaves max_tokens room (one token without it), so the
    prompts it exists for run; a k that leaves no room is a 400 naming it."""
    context = srv.state.max_seq_len
    long = [7, 8, 9] * (context // 3 + 5)
    r = client(srv).completions.create(
        model="tiny", prompt=long, max_tokens=5, extra_body={**FREE, "truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == context - 5 and r.usage.completion_tokens == 5
    r = client(srv).completions.create(model="tiny", prompt=long, extra_body={**FREE, "truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == context - 16  # a completion's default max_tokens
    chat = client(srv).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a b " * context}],
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert chat.usage.prompt_tokens == context - 1
    short = client(srv).completions.create(
        model="tiny", prompt=[7, 8, 9], max_tokens=2, extra_body={**FREE, "truncate_prompt_tokens": context}
    )
    assert short.usage.prompt_tokens == 3  # a k of the whole context leaves a shorter prompt as it is
    for k in (context, context + 1):
        bad = httpx.post(
            srv.url + C,
            json={"model": "tiny", "prompt": long, "max_tokens": 1, "truncate_prompt_tokens": k},
            timeout=30,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens", bad.text


def test_return_token_ids_gives_the_prompts_and_each_choices(srv, tokenizer):
    ids = tokenizer(PROMPT_TEXTS[3]).input_ids
    args = dict(
        model="tiny", prompt=PROMPT_TEXTS[3], max_tokens=6, temperature=0, extra_body={**FREE, "return_token_ids": True}
    )
    r = client(srv).completions.create(**args)
    choice = r.choices[0]
    assert choice.prompt_token_ids == ids and len(choice.token_ids) == 6
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    chunks = list(client(srv).completions.create(**args, stream=True))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert [t for ch in chunks for c in ch.choices for t in c.token_ids] == choice.token_ids
    chat = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=4, extra_body={**FREE, "return_token_ids": True}
    )
    assert chat.prompt_token_ids == chat_ids(tokenizer, MSG) and len(chat.choices[0].token_ids) == 4
    stream = list(
        client(srv).chat.completions.create(
            model="tiny", messages=MSG, max_tokens=4, stream=True, extra_body={**FREE, "return_token_ids": True}
        )
    )
    assert stream[0].prompt_token_ids == chat.prompt_token_ids
    assert len([t for ch in stream for c in ch.choices for t in (getattr(c, "token_ids", None) or [])]) == 4


def test_return_tokens_as_token_ids_writes_logprob_tokens_as_ids(srv):
    extra = {**FREE, "return_tokens_as_token_ids": True, "return_token_ids": True}
    r = client(srv).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[4], max_tokens=4, temperature=0, logprobs=2, extra_body=extra
    )
    lp, ids = r.choices[0].logprobs, r.choices[0].token_ids
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2, extra_body=extra
    )
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(srv, chat):
    args = dict(
        model="tiny",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=FREE,
    )
    c = client(srv)
    chunks = list(
        c.chat.completions.create(messages=MSG, **args) if chat else c.completions.create(prompt="Hi", **args)
    )
    assert all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1


def test_skip_special_tokens_false_shows_them(srv, tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    args = dict(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(special): 100})
    assert client(srv).completions.create(**args).choices[0].text == ""
    shown = client(srv).completions.create(**args, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3


def test_include_stop_str_in_output_keeps_the_stop_string_or_token_in_the_text(srv, tokenizer):
    args = dict(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=12, temperature=0)
    free = client(srv).completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    text, ids = free.text, free.token_ids
    stop = next(text[i : i + 2] for i in range(1, len(text) - 2) if text[i : i + 2].strip())
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client(srv).completions.create(**args, stop=[stop], extra_body=body).choices[0]
    streamed = client(srv).completions.create(**args, stop=[stop], extra_body=body, stream=True)
    assert kept.finish_reason == "stop" and kept.text == text[: text.find(stop) + len(stop)]
    assert "".join(c.choices[0].text for c in streamed) == kept.text
    chat = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    answer = chat.choices[0].message.content
    chat_stop = next(answer[i : i + 2] for i in range(1, len(answer) - 2) if answer[i : i + 2].strip())
    with_stop = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=12, temperature=0, stop=[chat_stop], extra_body=body
    )
    assert with_stop.choices[0].message.content == answer[: answer.find(chat_stop) + len(chat_stop)]
    # the stop token that ends the request: its text stays
    token = next(t for t in ids[3:] if tokenizer.decode([t]).strip() and t not in ids[:3])
    ended = client(srv).completions.create(**args, extra_body={**body, "stop_token_ids": [token]}).choices[0]
    assert ended.finish_reason == "stop" and ended.text == tokenizer.decode(ids[: ids.index(token) + 1])


def test_allowed_token_ids_keep_every_choices_tokens_in_the_set(srv, tokenizer):
    allowed = tokenizer(PROMPT_TEXTS[3], add_special_tokens=False).input_ids[:6]
    body = {"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True}
    args = dict(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=8, temperature=1, seed=5, n=2, extra_body=body)
    whole = client(srv).completions.create(**args)
    assert all(len(c.token_ids) == 8 and set(c.token_ids) <= set(allowed) for c in whole.choices)
    streamed = client(srv).completions.create(**args, stream=True)
    ids = [t for chunk in streamed for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]
    assert len(ids) == 16 and set(ids) <= set(allowed)
    chat = client(srv).chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
    )
    chat_ids = chat.choices[0].model_extra["token_ids"]
    assert len(chat_ids) == 6 and set(chat_ids) <= set(allowed)


@pytest.mark.parametrize(
    "value, says",
    [([], "must not be empty"), ([1, 10**6], "outside this model's vocabulary"), ("1", "list")],
)
def test_a_bad_allowed_token_ids_is_a_400_naming_it(srv, value, says):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "allowed_token_ids": value}
    r = httpx.post(srv.url + C, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert says in r.json()["error"]["message"]
    guided = {**body, "allowed_token_ids": [1, 2], "guided_regex": "a+"}
    r = httpx.post(srv.url + C, json=guided, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_bad_words_never_end_the_output(srv, tokenizer):
    from cluster.scheduler.token_set import bad_word_sequences

    args = dict(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=12, temperature=0)
    body = {"ignore_eos": True, "return_token_ids": True}
    free = client(srv).completions.create(**args, extra_body=body).choices[0]
    words = [tokenizer.decode(free.token_ids[3:4]), tokenizer.decode(free.token_ids[6:8])]
    banned = bad_word_sequences(tokenizer, words)
    cut = client(srv).completions.create(**args, extra_body={**body, "bad_words": words}).choices[0]
    ids = cut.token_ids
    assert ids != free.token_ids and len(ids) == 12
    assert not any(ids[i : i + len(w)] == w for w in banned for i in range(len(ids)))
    r = httpx.post(srv.url + C, json={**args, "bad_words": ["ok", ""]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


REFUSED = [
    (C, "use_beam_search", True),
    (C, "logits_processors", ["mod.proc"]),
    (C, "guided_whitespace_pattern", " "),
    (C, "prompt_logprobs", 21),
    (C, "truncate_prompt_tokens", 100_000),
    (C, "truncate_prompt_tokens", 0),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "documents", [{"title": "a", "text": "b"}]),  # the tiny model's template renders none
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "spaces_between_special_tokens", False),
]


def test_continue_final_message_continues_the_last_message_as_it_stands(srv, tokenizer):
    messages = [*MSG, {"role": "assistant", "content": "It is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    r = client(srv).chat.completions.create(model="tiny", messages=messages, max_tokens=3, extra_body=extra)
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("It is")
    assert r.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    bare = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1, extra_body={"add_generation_prompt": False, "return_token_ids": True}
    )
    opened = tokenizer.apply_chat_template(MSG, add_generation_prompt=False, tokenize=False)
    assert bare.prompt_token_ids == tokenizer(opened, add_special_tokens=False).input_ids
    counted = httpx.post(srv.url + "/tokenize", json={"messages": messages, **extra}, timeout=30).json()
    assert counted["tokens"] == r.prompt_token_ids


def test_the_template_switches_sent_as_null_are_their_defaults(srv, tokenizer):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 1, "return_token_ids": True}
    r = httpx.post(srv.url + CHAT, json={**body, "add_generation_prompt": None, "continue_final_message": None})
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == chat_ids(tokenizer, MSG), r.text


def test_continue_final_message_with_add_generation_prompt_is_a_400_naming_it(srv):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 1, "continue_final_message": True}
    for path in (CHAT, "/tokenize"):
        r = httpx.post(srv.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "continue_final_message" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,field,value", REFUSED, ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_a_field_that_is_not_honoured_is_a_400_naming_it(srv, path, field, value):
    base = {"model": "tiny", "max_tokens": 2, **({"messages": MSG} if path == CHAT else {"prompt": "Hi"})}
    r = httpx.post(srv.url + path, json={**base, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_prompt_logprobs_in_a_stream_are_a_400(srv):
    r = httpx.post(
        srv.url + C,
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True, "prompt_logprobs": 1},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize(
    "path,field,value",
    [
        (C, "use_beam_search", False),
        (C, "include_stop_str_in_output", False),
        (C, "bad_words", []),
        (CHAT, "add_generation_prompt", True),
        (CHAT, "modalities", ["text"]),
        (CHAT, "user", "someone"),
        (C, "guided_decoding_backend", "xgrammar"),
    ],
)
def test_fields_at_their_neutral_value_are_accepted(srv, path, field, value):
    base = {"model": "tiny", "max_tokens": 2, **({"messages": MSG} if path == CHAT else {"prompt": "Hi"})}
    r = httpx.post(srv.url + path, json={**base, field: value}, timeout=30)
    assert r.status_code == 200, r.text
