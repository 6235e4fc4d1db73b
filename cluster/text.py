"""An output's text as it reads after its prompt. A tokenizer whose decoder strips the space a word's first
piece carries at the start of a text (SentencePiece's Metaspace, as Llama 2's and Mistral's) decodes an
output's first token alone without it ("Paris" after "The capital of France is"); decoded behind the last
few prompt tokens, the output keeps it, as vLLM's does. Byte-level tokenizers (Llama 3's, Qwen's) give the
same text either way."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# prompt tokens an output is decoded behind: enough for the word before it
PROMPT_TAIL_TOKENS = 5
# how many tokens a character's bytes may span (byte-fallback or byte-level tokens: four at most, so three
# beside the one a tail's end or start is at)
_CHAR_TOKENS = 3
# output tokens after which a stream stops asking whether its first characters finish the prompt's: an
# output of whole characters shows its first within a character's tokens; one that has not by then begins
# with stray bytes of its own (its text holds U+FFFD either way)
_UNDECIDED_TOKENS = 2 * (_CHAR_TOKENS + 1)


def prompt_tail(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], skip_special_tokens: bool = True
) -> tuple[list[int], list[int]]:
    """The prompt tokens an output is decoded behind, in two parts: about PROMPT_TAIL_TOKENS whose text ends
    between characters, and the ones after them, which begin a character the prompt leaves unfinished (the
    output's, if the output finishes it). The tail starts between characters where a few tokens more or
    less allow it (a byte-fallback decoder shows every byte of a run of byte tokens as U+FFFD where one is
    astray, Llama 2's does); its text is taken off the front of the whole text either way, and where the
    output changes it, the output is decoded alone. Where no few tokens end a character (stray bytes
    throughout), none: the output is decoded alone, so that no prompt text shows in it."""
    ids = list(prompt_ids)
    if _ends_with_replacement_character(tokenizer, ids):
        return [], []  # written so, not a character's first bytes: nothing for the output to complete

    def text(start: int, end: int) -> str:
        return tokenizer.backend_tokenizer.decode(ids[max(0, start) : end], skip_special_tokens=skip_special_tokens)

    for cut in range(min(_CHAR_TOKENS, len(ids)) + 1):
        end = len(ids) - cut
        starts = [max(0, end - PROMPT_TAIL_TOKENS - back) for back in range(_CHAR_TOKENS + 1)]
        # a start inside a byte-fallback run shows the whole run as U+FFFD, its end too: the end is a
        # character's where a start shows it whole
        texts = {s: text(s, end) for s in starts}
        whole = [s for s, t in texts.items() if not t.endswith("\ufffd")]
        if whole:
            start = next((s for s in whole if s == 0 or not texts[s].startswith("\ufffd")), whole[0])
            return ids[start:end], ids[end:]
    return [], []  # stray bytes throughout the last few tokens: the output is decoded alone


def _ends_with_replacement_character(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> bool:
    """Whether the prompt ends with U+FFFD itself (its own text, which the output must not take for the
    start of one of its characters)."""
    char = _replacement_character(tokenizer)
    return bool(char) and ids[-len(char) :] == list(char)


@functools.lru_cache(maxsize=4)
def _replacement_character(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """U+FFFD's tokens as the tokenizer writes the character after a letter (the router and an offline
    engine hold one tokenizer for their life)."""
    letter = tokenizer.encode("a", add_special_tokens=False)
    both = tokenizer.encode("a\ufffd", add_special_tokens=False)
    return tuple(both[len(letter) :]) if both[: len(letter)] == letter else ()


def text_after(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    ids: Sequence[int],
    skip_special_tokens: bool = True,
) -> str:
    """The text `ids` add after the prompt `prompt_ids`: the decode of both (its last tokens) less the
    prompt's own."""
    return _text_behind(tokenizer, *prompt_tail(tokenizer, prompt_ids, skip_special_tokens), ids, skip_special_tokens)


def _text_behind(
    tokenizer: PreTrainedTokenizerBase,
    tail: list[int],
    carried: list[int],
    ids: Sequence[int],
    skip_special_tokens: bool,
) -> str:
    """The text `ids` add after prompt_tail's two parts: with the carried bytes where the output finishes
    their character, without them where it begins one of its own (the bytes then stay the prompt's)."""
    text = _decode_behind(tokenizer, tail, [*carried, *ids], skip_special_tokens)
    if not carried:
        return text
    unfinished = _decode_behind(tokenizer, tail, carried, skip_special_tokens)
    if unfinished.endswith("\ufffd") and text.startswith(unfinished):
        return _decode_behind(tokenizer, tail, list(ids), skip_special_tokens)
    return text


def _decode_behind(
    tokenizer: PreTrainedTokenizerBase, tail: list[int], ids: list[int], skip_special_tokens: bool
) -> str:
    """The decode of tail and ids less tail's own."""
    backend = tokenizer.backend_tokenizer
    head = backend.decode(tail, skip_special_tokens=skip_special_tokens)
    whole = backend.decode([*tail, *ids], skip_special_tokens=skip_special_tokens)
    if whole.startswith(head):
        return whole[len(head) :]
    return backend.decode(ids, skip_special_tokens=skip_special_tokens)


class TextStream:
    """The text each output token adds after the prompt, as the tokens arrive: nothing while they end inside
    a character, then all of it. tokenizers' DecodeStream does it in Rust, but raises where a byte-fallback
    run's earlier text changes with a later byte (a stray byte, as a model with random weights or a cut
    character gives, shows the run's every byte as U+FFFD): from there on the stream goes as vLLM's
    offsets do, decoding the new tokens behind those of the last piece given (which start and end between
    characters: a window that began inside a run of byte tokens would show the whole run as U+FFFD) and
    giving what lies past that piece's text."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer, self._backend, self._skip = tokenizer, tokenizer.backend_tokenizer, skip_special_tokens
        tail, carried = prompt_tail(tokenizer, prompt_ids, skip_special_tokens)
        self._tail, self._carried = tail, carried
        self._stream: DecodeStream | None = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
        self._ids = list(tail)
        # the tokens before _read have given their text; those from _prefix to _read gave the last piece
        # (at first the prompt's tail), which the fallback decodes the new tokens behind
        self._prefix, self._read = 0, len(tail)
        self._unfinished = ""
        self.carried = "".join(self.step(t) for t in carried)  # "" unless a carried token ends the character
        if carried and not self.carried:
            # the carried bytes' text (U+FFFD), which a first piece still starts with if the output does not
            # finish their character
            self._unfinished = _decode_behind(tokenizer, tail, carried, skip_special_tokens)

    def step(self, token_id: int) -> str:
        piece = self._next(token_id)
        if not self._unfinished:
            return piece
        if piece:
            unfinished, self._unfinished = self._unfinished, ""
            if unfinished.endswith("\ufffd") and piece.startswith(unfinished):
                piece = self._without_carried()  # the output began a character of its own
            return piece
        # nothing yet: the carried bytes and the output's may run together as one invalid run of byte tokens
        # (a byte-fallback decoder shows it all as U+FFFD) while the output's own bytes already make whole
        # characters, which decide it: the output began characters of its own
        out = self._ids[len(self._tail) + len(self._carried) :]
        own = _decode_behind(self._tokenizer, self._tail, out, self._skip)
        if own and not own.startswith("\ufffd") and not own.endswith("\ufffd"):
            self._unfinished = ""
            return self._without_carried()
        if own and len(out) > _UNDECIDED_TOKENS:  # stray bytes of the output's own: not decoded every token
            self._unfinished = ""
            return self._after_tail()  # they did not finish the carried character, which stays the prompt's
        return ""

    def _after_tail(self) -> str:
        """Drops the carried tokens from the stream, which goes on as vLLM's offsets do from the prompt's tail
        with the output's tokens so far (decoded alone where their bytes change the tail's text)."""
        self._drop_carried()
        self._prefix, self._read = 0, len(self._tail)
        self._stream = None
        return self._offsets_piece(whole=False)

    def _without_carried(self) -> str:
        """Drops the carried tokens from the stream and gives the text of the output's tokens so far behind
        the tail alone (they end a character: their text has just been given)."""
        out = self._drop_carried()
        self._prefix, self._read = len(self._tail), len(self._ids)
        self._stream = DecodeStream(ids=self._ids, skip_special_tokens=self._skip)
        return _decode_behind(self._tokenizer, self._tail, out, self._skip)

    def _drop_carried(self) -> list[int]:
        """Takes the carried tokens out of the stream's tokens; gives the output's tokens so far."""
        out = self._ids[len(self._tail) + len(self._carried) :]
        self._carried = []
        self._ids = [*self._tail, *out]
        return out

    def _next(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # the tokenizers' own (pyo3) exception: only its message says what it is
                self._stream = None
            else:
                if piece is None:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)
                return piece
        return self._offsets_piece(whole=False)

    def _offsets_piece(self, whole: bool) -> str:
        """The unread tokens' text behind the last piece's (where `whole` is False, none while it ends inside
        a character). Where a byte's arrival changed the text before it, what was given stays given: the
        length decides."""
        before = self._backend.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        now = self._backend.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if self._read == len(self._tail) and not self._carried and not now.startswith(before):
            # nothing given yet, and the output's bytes changed the prompt tail's text (one run of byte tokens
            # across both): the output is decoded alone, as text_after decodes it, so that none of the
            # prompt's characters show in it as U+FFFD
            self._prefix, before = self._read, ""
            now = self._backend.decode(self._ids[self._read :], skip_special_tokens=self._skip)
        if len(now) <= len(before) or (not whole and now.endswith("\ufffd")):
            return ""  # inside a character (or nothing shown yet)
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def rest(self) -> str:
        """The text of the tokens that have given none yet, bytes of an unfinished character as U+FFFD: the
        end of a stream whose given text a whole decode no longer begins with (a later stray byte turned
        characters already given into U+FFFD), so that what followed them is not lost."""
        if self._unfinished or self._read == len(self._ids):
            return ""
        return self._offsets_piece(whole=True)

    def whole(self, ids: Sequence[int]) -> str:
        """The text of all of `ids` (the output's tokens so far) after the prompt, decoded at once, as
        text_after gives it."""
        return _text_behind(self._tokenizer, self._tail, self._carried, ids, self._skip)
