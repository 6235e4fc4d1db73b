"""Logprobs over a byte-level BPE tokenizer's tokens, with the real openai client, as vLLM writes them:
a token that is not whole UTF-8 characters is `bytes:\\xNN...`, so top_logprobs keys never collide;
the tokens' bytes make the text; text_offset indexes the returned text; chat's `bytes` are each
token's own bytes; logprobs 0 gives the sampled token's logprob."""

from __future__ import annotations

import pytest
from fixtures import PROMPT_TEXTS
from helpers import client, serving

from cluster.model_info import load_tokenizer

CJK, EMOJI = PROMPT_TEXTS[4], PROMPT_TEXTS[5]  # split into byte tokens by the tiny tokenizer
TOP = 20


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, num_pages=512, max_running_reqs=8) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def no_specials(tokenizer) -> dict[str, int]:
    """Bans the special tokens, which the text leaves out (skip_special_tokens) but tokens show."""
    return {str(i): -100 for i in tokenizer.all_special_ids}


def raw(token: str) -> bytes:
    """A logprob token's bytes, read back from its written form."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


@pytest.fixture(scope="module")
def echoed(srv, tokenizer):
    """An echoed CJK and emoji prompt and 24 sampled tokens, with 20 top logprobs each."""
    return client(srv).completions.create(
        model="tiny",
        prompt=CJK + EMOJI,
        max_tokens=24,
        temperature=1,
        seed=7,
        echo=True,
        logprobs=TOP,
        logit_bias=no_specials(tokenizer),
        extra_body={"ignore_eos": True},
    )


def test_a_token_that_is_not_whole_characters_is_written_as_its_bytes(echoed):
    tokens = echoed.choices[0].logprobs.tokens
    partial = [t for t in tokens if t.startswith("bytes:")]
    assert partial, "the prompt's CJK characters are split into byte tokens"
    for t in partial:
        with pytest.raises(UnicodeDecodeError):
            raw(t).decode()  # only bytes that are not whole characters are written so


def test_top_logprobs_have_as_many_distinct_keys_as_asked(echoed):
    lp = echoed.choices[0].logprobs
    tops = lp.top_logprobs
    assert tops[0] is None  # the prompt's first token: nothing comes before it
    # the most likely and the position's own token, where it is not among them
    assert all(len(top) == TOP + (token not in list(top)[:TOP]) for token, top in zip(lp.tokens[1:], tops[1:]))
    # several byte tokens, which all decode to U+FFFD, among the most likely at some position
    assert max(sum(k.startswith("bytes:") for k in top) for top in tops[1:]) >= 2


def test_the_tokens_bytes_make_the_text(echoed):
    lp = echoed.choices[0].logprobs
    assert b"".join(raw(t) for t in lp.tokens).decode("utf-8", errors="replace") == echoed.choices[0].text
    whole = [t for t in lp.tokens if not t.startswith("bytes:")]
    if len(whole) == len(lp.tokens):
        assert "".join(lp.tokens) == echoed.choices[0].text


def test_text_offset_indexes_the_returned_text(echoed):
    text, lp = echoed.choices[0].text, echoed.choices[0].logprobs
    offsets, prompt = lp.text_offset, echoed.usage.prompt_tokens
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    done = 0  # bytes of the echoed prompt (valid UTF-8, as the text holds it) before each token
    for token, offset in zip(lp.tokens[:prompt], offsets):
        # a token that starts inside a character points at that character
        assert offset == len((CJK + EMOJI).encode()[:done].decode("utf-8", errors="ignore"))
        done += len(raw(token))
    for token, offset in zip(lp.tokens, offsets):
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token


def test_an_echoed_prompts_special_tokens_count_in_text_offset(srv, tokenizer):
    """The echo shows the prompt as sent, its special tokens too: their text counts in the offsets, while
    the output's skipped special tokens add none (skip_special_tokens, the default)."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n"
    for sent in (prompt, tokenizer(prompt, add_special_tokens=False).input_ids):
        r = client(srv).completions.create(
            model="tiny",
            prompt=sent,
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert text.startswith(prompt)
        for token, offset in zip(lp.tokens, lp.text_offset):
            if not token.startswith("bytes:") and offset < len(prompt):
                assert text[offset : offset + len(token)] == token
        assert lp.text_offset[r.usage.prompt_tokens] == len(prompt)  # the first output token starts after it


def test_streamed_text_offsets_equal_the_whole_ones(srv, tokenizer, echoed):
    chunks = client(srv).completions.create(
        model="tiny",
        prompt=CJK + EMOJI,
        max_tokens=24,
        temperature=1,
        seed=7,
        echo=True,
        logprobs=TOP,
        logit_bias=no_specials(tokenizer),
        extra_body={"ignore_eos": True},
        stream=True,
    )
    offsets, tokens = [], []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == echoed.choices[0].logprobs.tokens
    assert offsets == echoed.choices[0].logprobs.text_offset


def test_chat_bytes_are_each_tokens_own_bytes(srv, tokenizer):
    r = client(srv).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": CJK}],
        max_tokens=24,
        temperature=1,
        seed=3,
        logprobs=True,
        top_logprobs=TOP,
        logit_bias=no_specials(tokenizer),
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    ids = choice.model_extra["token_ids"]
    assert any(e.token.startswith("bytes:") for e in content), "some sampled token is part of a character"
    for token_id, entry in zip(ids, content):
        own = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
        assert bytes(entry.bytes) == raw(entry.token)
        if not entry.token.startswith("bytes:"):
            assert entry.token == own
        assert len({t.token for t in entry.top_logprobs}) == TOP
        for top in entry.top_logprobs:
            assert bytes(top.bytes) == raw(top.token)
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content


def test_logprobs_0_returns_the_sampled_tokens_logprob(srv, tokenizer):
    args = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=1, seed=11, extra_body={"ignore_eos": True})
    zero = client(srv).completions.create(logprobs=0, **args).choices[0].logprobs
    five = client(srv).completions.create(logprobs=5, **args).choices[0].logprobs
    assert zero.tokens == five.tokens and len(zero.token_logprobs) == 6
    assert zero.token_logprobs == pytest.approx(five.token_logprobs, abs=1e-5)
    assert zero.top_logprobs == [{t: lp} for t, lp in zip(zero.tokens, zero.token_logprobs)]
