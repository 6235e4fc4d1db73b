"""The sampling surface over HTTP with the real openai client: bad values are 400s naming the field; n
choices (whole and streamed) with their own indices, finish reasons, stop strings and seeds; echo; the
biases reach the engine."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from fixtures import PROMPT_TEXTS, _load_model
from helpers import client, serving
from test_observe import sample_value
from test_serve import check_replicas_whole, wait_until_idle

from cluster.model_info import load_tokenizer

MAX_N, MAX_LOGIT_BIAS = 4, 8
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
MSG = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=1024, max_running_reqs=32, max_n=MAX_N, max_logit_bias=MAX_LOGIT_BIAS) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def sampled(srv, **kw) -> openai.types.Completion:
    """A seeded completion of 8 tokens at temperature 1 (EOS does not end it), each choice's tokens in
    its logprobs."""
    args = dict(
        model="tiny",
        prompt=PROMPT_TEXTS[3],
        max_tokens=8,
        temperature=1,
        seed=1234,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    return client(srv).completions.create(**{**args, **kw})


def texts(completion) -> list[str]:
    return [c.text for c in sorted(completion.choices, key=lambda c: c.index)]


BAD = [  # (field, path, body): each a 400 whose param names the field
    ("presence_penalty", C, {**OK, "presence_penalty": 2.01}),
    ("presence_penalty", CHAT, {"model": "tiny", "messages": MSG, "presence_penalty": -2.5}),
    ("frequency_penalty", C, {**OK, "frequency_penalty": 3}),
    ("frequency_penalty", CHAT, {"model": "tiny", "messages": MSG, "frequency_penalty": -2.01}),
    ("repetition_penalty", C, {**OK, "repetition_penalty": 0}),
    ("repetition_penalty", CHAT, {"model": "tiny", "messages": MSG, "repetition_penalty": -1.0}),
    ("repetition_penalty", C, {**OK, "repetition_penalty": 1e5}),  # past float32's finite arithmetic
    ("repetition_penalty", CHAT, {"model": "tiny", "messages": MSG, "repetition_penalty": 0}),
    ("min_p", C, {**OK, "min_p": -0.1}),
    ("min_p", CHAT, {"model": "tiny", "messages": MSG, "min_p": 1.01}),
    ("min_tokens", C, {**OK, "min_tokens": 5}),  # max_tokens is 4
    ("min_tokens", C, {**OK, "min_tokens": -1}),
    ("min_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": 2, "min_tokens": 3}),
    ("logit_bias", C, {**OK, "logit_bias": {"5": 100.5}}),
    ("logit_bias", C, {**OK, "logit_bias": {"5": -101}}),
    ("logit_bias", C, {**OK, "logit_bias": {"-1": 1}}),
    ("logit_bias", C, {**OK, "logit_bias": {"five": 1}}),
    ("logit_bias", C, {**OK, "logit_bias": {"10000000": 1}}),
    (
        "logit_bias",
        CHAT,
        {"model": "tiny", "messages": MSG, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
    ),  # more than the table holds
    ("logit_bias", C, {**OK, "logit_bias": {"5": "high"}}),
    ("n", C, {**OK, "n": MAX_N + 1}),
    ("n", CHAT, {"model": "tiny", "messages": MSG, "n": 0}),
    ("best_of", C, {**OK, "n": 2, "best_of": 3}),
    ("echo", CHAT, {"model": "tiny", "messages": MSG, "echo": True}),
]


@pytest.mark.parametrize("field,path,body", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_sampling_value_is_a_400_naming_its_field(srv, field, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # a value of the wrong type is named down to its key (logit_bias.5)
    assert err["param"].split(".")[0] == field and field in err["message"], err


def test_the_vocabulary_bound_of_logit_bias_is_the_models(srv, tokenizer):
    vocab = len(tokenizer)
    assert httpx.post(srv.url + C, json={**OK, "logit_bias": {str(vocab): 1}}).status_code == 400
    assert httpx.post(srv.url + C, json={**OK, "logit_bias": {str(vocab - 1): 1}}).status_code == 200


def test_every_sampling_field_at_a_valid_value_is_served(srv):
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
        "min_p": 0.05,
        "min_tokens": 2,
        "logit_bias": {"7": -3.5, "9": 2},
        "seed": 3,
    }
    for path, body in ((C, {**OK, **fields}), (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 4, **fields})):
        r = httpx.post(srv.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert 2 <= r.json()["usage"]["completion_tokens"] <= 4


def test_n_choices_have_indices_their_own_finish_reasons_and_usage_counts_them_all(srv, tokenizer):
    r = sampled(srv, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 8 for c in r.choices)
    assert r.usage.prompt_tokens == len(tokenizer(PROMPT_TEXTS[3]).input_ids)  # the prompt counts once
    assert r.usage.completion_tokens == 24
    chat = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=5, n=3, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 15
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in chat.choices)


def test_an_n_choice_request_is_one_request_in_the_metrics(srv):
    def counts() -> tuple[float, ...]:
        text = httpx.get(srv.url + "/metrics").text
        return tuple(
            sample_value(text, name)
            for name in (
                "raylm:request_success_total",
                "raylm:generation_tokens_total",
                "raylm:time_per_output_token_seconds_count",
                "raylm:num_requests_running",
            )
        )

    before = counts()
    sampled(srv, n=3)
    after = counts()
    assert [b - a for a, b in zip(before, after)] == [1, 24, 1, 0]
    assert after[3] == 0


def test_seeded_choices_are_reproducible_differ_and_the_first_is_the_one_choice_request(srv):
    first, again = sampled(srv, n=3), sampled(srv, n=3)
    assert texts(first) == texts(again)
    assert len(set(texts(first))) == 3
    assert texts(sampled(srv, n=1)) == texts(first)[:1]


def test_streamed_choices_carry_their_index_and_equal_the_whole_ones(srv):
    whole = sampled(srv, n=3)
    chunks = list(
        client(srv).completions.create(
            model="tiny",
            prompt=PROMPT_TEXTS[3],
            max_tokens=8,
            temperature=1,
            seed=1234,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = {
        i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)
    }
    assert list(streamed.values()) == texts(whole)
    finishes = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason == "length"]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 24


def test_streamed_chat_choices_each_open_with_the_role(srv):
    chunks = list(
        client(srv).chat.completions.create(
            model="tiny", messages=MSG, max_tokens=4, n=3, seed=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    roles = [ch.choices[0].index for ch in chunks if ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2] and len(chunks) > 3
    whole = client(srv).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=4, n=3, seed=5, extra_body={"ignore_eos": True}
    )
    for c in whole.choices:
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == c.index)
        assert text == c.message.content


def test_a_stop_string_ends_only_the_choices_that_produce_it(srv):
    full = texts(sampled(srv, n=3, max_tokens=16))
    # three plain characters from a later choice's text
    stop = next(
        t[i : i + 3] for t in full[1:] for i in range(len(t) - 3) if t[i : i + 3].isascii() and t[i : i + 3].strip()
    )
    cut = sampled(srv, n=3, max_tokens=16, stop=[stop])
    for text, choice in zip(full, sorted(cut.choices, key=lambda c: c.index)):
        if stop in text:
            assert (choice.text, choice.finish_reason) == (text[: text.find(stop)], "stop")
        else:
            assert (choice.text, choice.finish_reason) == (text, "length")
    check_replicas_whole(srv)


def test_the_token_that_ends_a_request_adds_no_text_and_stays_in_its_token_ids(srv, tokenizer):
    args = dict(model="tiny", prompt=PROMPT_TEXTS[1], max_tokens=12, temperature=0)
    free = client(srv).completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = free.choices[0].token_ids
    stop = next(t for t in ids[3:] if tokenizer.decode([t]).strip() and t not in ids[:3])
    body = {"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop]}
    cut = client(srv).completions.create(**args, extra_body=body)
    streamed = client(srv).completions.create(**args, extra_body=body, stream=True)
    kept = ids[: ids.index(stop) + 1]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].token_ids == kept
    assert cut.choices[0].text == tokenizer.decode(kept[:-1]) == "".join(c.choices[0].text for c in streamed)


def test_stop_strings_count_only_past_min_tokens(srv):
    args = dict(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = client(srv).completions.create(**args).choices[0].text
    stop = next(text[i : i + 2] for i in range(len(text) - 2) if text[i : i + 2].strip())
    first = client(srv).completions.create(**args, stop=[stop]).choices[0]
    late = client(srv).completions.create(**{**args, "extra_body": {"ignore_eos": True, "min_tokens": 12}}, stop=[stop])
    assert first.text == text[: text.find(stop)] and first.finish_reason == "stop"
    assert late.choices[0].text == text and late.choices[0].finish_reason == "length"
    assert late.usage.completion_tokens == 12


def test_completion_top_logprobs_hold_the_sampled_token_too(srv, tokenizer):
    r = client(srv).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[3], max_tokens=8, temperature=1.5, seed=11, logprobs=1
    )
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2


def test_a_max_completion_tokens_past_the_context_is_named_as_sent(srv):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MSG, "max_completion_tokens": 10**6},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert r.json()["error"]["message"].startswith("max_completion_tokens")


def test_a_disconnect_mid_stream_aborts_every_choice(srv):
    body = {
        "model": "tiny",
        "prompt": PROMPT_TEXTS[4],
        "max_tokens": 400,
        "ignore_eos": True,
        "n": 3,
        "seed": 9,
        "stream": True,
    }
    decoded_before = sum(s.decode_tokens for s in wait_until_idle(srv))
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + C, json=body) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
    stats = wait_until_idle(srv)
    assert [s.live for s in stats] == [0]
    assert sum(s.decode_tokens for s in stats) - decoded_before < 600  # of 1200: the aborts landed early
    check_replicas_whole(srv)


def test_echo_returns_the_prompt_before_each_choice(srv):
    c = client(srv)
    plain = c.completions.create(model="tiny", prompt=PROMPT_TEXTS[1], max_tokens=6, temperature=0)
    echoed = c.completions.create(model="tiny", prompt=PROMPT_TEXTS[1], max_tokens=6, temperature=0, echo=True, n=2)
    assert [ch.text for ch in echoed.choices] == [PROMPT_TEXTS[1] + plain.choices[0].text] * 2
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    chunks = list(
        c.completions.create(model="tiny", prompt=PROMPT_TEXTS[1], max_tokens=6, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text.startswith(PROMPT_TEXTS[1])
    assert "".join(ch.choices[0].text for ch in chunks) == echoed.choices[0].text


def test_echo_of_token_ids_returns_them_decoded(srv, tokenizer):
    ids = tokenizer(PROMPT_TEXTS[2]).input_ids
    r = client(srv).completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(tokenizer.decode(ids))


def test_echo_with_logprobs_puts_the_prompt_tokens_first(srv, tokenizer):
    ids = tokenizer(PROMPT_TEXTS[6]).input_ids
    r = client(srv).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[6], max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs[len(ids) :])


def test_echoed_prompt_logprobs_equal_the_models_for_every_choice(srv, tokenizer, qwen3_path):
    ids = tokenizer(PROMPT_TEXTS[6]).input_ids
    r = client(srv).completions.create(
        model="tiny", prompt=PROMPT_TEXTS[6], max_tokens=2, temperature=1, seed=4, echo=True, logprobs=2, n=2
    )
    with torch.no_grad():
        logits = _load_model(qwen3_path)(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    for choice in r.choices:
        lp = choice.logprobs
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-3)
        # the 2 most likely and the prompt's own token (OpenAI's legacy completions: up to logprobs + 1)
        for token, top in zip(lp.tokens[1 : len(ids)], lp.top_logprobs[1 : len(ids)]):
            assert token in top and 1 <= len(top) <= 3


def hf_greedy_biased(path, ids: list[int], max_new_tokens: int, bias: dict[int, float]) -> list[int]:
    """Hugging Face's greedy tokens with a one-token bias per id (EOS does not stop it)."""
    model = _load_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            sequence_bias={(t,): b for t, b in bias.items()} or None,
        )
    return out[0, len(ids) :].tolist()


def test_a_logit_bias_of_100_forces_its_token(srv, tokenizer):
    forced = tokenizer(" the", add_special_tokens=False).input_ids[-1]
    r = client(srv).completions.create(
        model="tiny",
        prompt=PROMPT_TEXTS[5],
        max_tokens=6,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tokenizer.decode([forced] * 6, skip_special_tokens=True)


def test_a_logit_bias_of_minus_100_bans_the_greedy_token(srv, tokenizer, qwen3_path):
    ids = tokenizer(PROMPT_TEXTS[5]).input_ids
    greedy = hf_greedy_biased(qwen3_path, ids, 8, {})
    banned = hf_greedy_biased(qwen3_path, ids, 8, {greedy[0]: -100.0})
    assert greedy[0] not in banned
    r = client(srv).completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=8,
        temperature=0,
        logit_bias={str(greedy[0]): -100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tokenizer.decode(banned, skip_special_tokens=True)
