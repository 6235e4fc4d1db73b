"""Stream chunks built on the fast path are the very bytes the general formatter gives, and every event
stays one line for clients that split lines as str.splitlines does."""

from __future__ import annotations

import json

import pytest

from router.http.responses import Formatter, sse
from router.replicas.generation import Piece


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize(
    "piece",
    [
        Piece("Hello", [5]),
        Piece("", [6]),
        Piece(' "quoted"\n\tand \\ back', [7, 8]),
        Piece("héllo ✓ 日本", [9]),
        Piece("end", [10], finish_reason="stop"),
        Piece("", [11], finish_reason="length"),
        Piece("a\x85b\u2028c\u2029d\x1c\x0be", [12]),
    ],
    ids=["text", "empty", "escapes", "unicode", "last-with-text", "last-empty", "line-ends"],
)
def test_fast_stream_chunk_equals_the_general_one(chat, piece):
    fmt = Formatter("id-1", 'model "x" ü', chat, tokenizer=None, top_logprobs=None)
    fast = fmt.chunk_sse(piece)
    assert fast == sse(fmt.chunk(piece))
    assert json.loads(fast.removeprefix("data: "))["choices"][0]["finish_reason"] == piece.finish_reason


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_token_text_with_line_ends_never_splits_its_event(chat):
    # httpx's iter_lines ends a line wherever str.splitlines does: at NEL and the Unicode separators too
    text = "x\x85y\u2028z\u2029\r\n\x1c\x0c"
    fmt = Formatter("id-1", "m\u2028", chat, tokenizer=None, top_logprobs=None)
    for event in (fmt.chunk_sse(Piece(text, [1])), sse(fmt.chunk(Piece(text, [1]))), sse({"error": {"message": text}})):
        assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
        body = json.loads(event[len("data: ") :])
        got = (
            body["error"]["message"]
            if "error" in body
            else body["choices"][0].get("text") or body["choices"][0]["delta"]["content"]
        )
        assert got == text
