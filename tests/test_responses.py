"""Stream chunks built on the fast path are the very bytes the general formatter gives."""

from __future__ import annotations

import json

import pytest

from router.generation import Piece
from router.responses import Formatter, sse


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("piece", [
    Piece("Hello", [5]), Piece("", [6]), Piece(' "quoted"\n\tand \\ back', [7, 8]), Piece("héllo ✓ 日本", [9]),
    Piece("end", [10], finish_reason="stop"), Piece("", [11], finish_reason="length"),
], ids=["text", "empty", "escapes", "unicode", "last-with-text", "last-empty"])
def test_fast_stream_chunk_equals_the_general_one(chat, piece):
    fmt = Formatter("id-1", 'model "x" ü', chat, tokenizer=None, top_logprobs=None)
    fast = fmt.chunk_sse(piece)
    assert fast == sse(fmt.chunk(piece))
    assert json.loads(fast.removeprefix("data: "))["choices"][0]["finish_reason"] == piece.finish_reason
