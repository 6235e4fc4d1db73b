"""The router's incremental detokenizer as vLLM's behaves: the token that ends a request adds no text, and
a stop string counts only where it ends past the text of the first min_tokens tokens, whatever the
other stop strings hold back."""

from __future__ import annotations

import pytest

from cluster.model_info import load_tokenizer
from router.chat.detokenizer import IncrementalDetokenizer

TEXT = "the cat sat on the mat and then the dog ran off to the park"


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def detokenized(
    tokenizer, ids: list[int], stops: list[str], min_tokens: int = 0, ends: frozenset = frozenset(), include=False
):
    d = IncrementalDetokenizer(tokenizer, stops, True, ends, min_tokens, include_stops=include)
    text = "".join(d.add(t, ends=i == len(ids) - 1) for i, t in enumerate(ids)) + d.flush()
    return text, d.stopped


def test_the_token_that_ends_a_request_adds_no_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    last = ids[-1]
    assert detokenized(tokenizer, ids, [], ends=frozenset([last]))[0] == tokenizer.decode(ids[:-1])
    # the same token ending nothing (not a stop token) is text as any other
    assert detokenized(tokenizer, ids, [])[0] == tokenizer.decode(ids)


def test_a_stop_within_the_first_min_tokens_counts_with_or_without_longer_stops(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    head = tokenizer.decode(ids[:6])
    whole = tokenizer.decode(ids)
    inside = next(c for c in head if c.strip() and c not in whole[len(head) :])
    for stops in ([inside], [inside, "z" * 40]):
        assert detokenized(tokenizer, ids, stops, min_tokens=6) == (whole, False)
        text, stopped = detokenized(tokenizer, ids, stops)  # without min_tokens it stops there
        assert stopped and text == whole[: whole.find(inside)]


def test_a_stop_past_min_tokens_cuts_the_text_before_it(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    head, whole = tokenizer.decode(ids[:6]), tokenizer.decode(ids)
    for stop in ("park", "dog"):
        assert detokenized(tokenizer, ids, [stop, "z" * 40], min_tokens=6) == (whole[: whole.find(stop)], True)
    assert whole.find("the", len(head)) > 0
    # "the" opens the text, inside min_tokens: its first occurrence past them cuts
    assert detokenized(tokenizer, ids, ["the"], min_tokens=6)[0] == whole[: whole.find("the", len(head))]


def test_an_included_stop_string_ends_the_text_and_nothing_after_it_is_shown(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    whole = tokenizer.decode(ids)
    for stops in (["dog"], ["z" * 40, "dog"], ["park", "dog"]):  # the earliest found
        text, stopped = detokenized(tokenizer, ids, stops, include=True)
        assert stopped and text == whole[: whole.find("dog") + len("dog")]
    assert detokenized(tokenizer, ids, ["dog"])[0] == whole[: whole.find("dog")]  # left out by default


def test_an_included_stop_token_adds_its_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    last = frozenset([ids[-1]])
    assert detokenized(tokenizer, ids, [], ends=last, include=True)[0] == tokenizer.decode(ids)
    assert detokenized(tokenizer, ids, [], ends=last)[0] == tokenizer.decode(ids[:-1])
