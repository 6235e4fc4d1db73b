"""A token as logprobs show it: its own bytes, and its text, written `bytes:\\xNN...` (OpenAI's and
vLLM's convention) when those bytes are not whole UTF-8 characters, so that distinct tokens never share
a key; and each token's text_offset into the text its choice returns."""

from __future__ import annotations

import codecs
import functools
import json
import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

from cluster import text_after

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens of one raw byte


class TokenBytes:
    """The bytes and logprob text of a tokenizer's tokens, worked out once per token id."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.special = frozenset(tokenizer.all_special_ids)
        self.byte_level = _byte_level(tokenizer)
        self._unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes: dict[int, bytes] = {}
        self._letter = tokenizer.encode("a", add_special_tokens=False)  # what a piece is decoded behind

    def of(self, token_id: int) -> bytes:
        """The token's bytes: a byte-level BPE piece mapped back through its byte alphabet, a byte
        fallback piece's byte, an added token's text."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._work_out(token_id)
        return cached

    def _work_out(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece is None:  # an id the tokenizer does not have
            return b""
        if self.byte_level and all(c in self._unicode_to_byte for c in piece):
            return bytes(self._unicode_to_byte[c] for c in piece)
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        # decoded behind a letter: a SentencePiece decoder strips the space a word's piece carries at the
        # start of a text ("▁Paris" alone is "Paris"), which the token adds inside one
        return text_after(self.tok, self._letter, [token_id], False).encode()

    def text(self, token_id: int) -> str:
        """The token as a logprob key: its text when its bytes are whole characters, else
        `bytes:` and each byte as \\xNN."""
        raw = self.of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def shown(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """What the token adds to its choice's text (a skipped special token adds nothing)."""
        return b"" if skip_special_tokens and token_id in self.special else self.of(token_id)


@functools.lru_cache(maxsize=4)
def token_bytes(tokenizer) -> TokenBytes:
    """The one TokenBytes of a tokenizer (the router holds one tokenizer for its life)."""
    return TokenBytes(tokenizer)


class TextOffsets:
    """One choice's text_offset: where each token starts in the text returned, counted in characters.
    A token that starts inside a character split over several tokens points at that character."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, shown: bytes) -> int:
        """The next token's offset; `shown` is what it adds to the text."""
        offset = self.chars
        self.chars += len(self._decoder.decode(shown))
        return offset


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's (GPT-2's byte alphabet)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)
