"""Token masks that need no grammar, vLLM's allowed_token_ids and bad_words: a request that may sample only
the tokens of a set, or never a bad word's last token after the rest of that word. They ride the grammars'
path (a matcher per request whose next-token bitmask masks the logits on the device, in decode, verify and
every other step) with a matcher of their own, so nothing is compiled."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The tokenizer's Rust tokenizer as `encode` runs it: a copy without the padding or truncation its
    tokenizer.json may have been saved with (a fine-tune saved after a padded call keeps them), which
    would pad every word to the longest."""
    backend = tokenizer.backend_tokenizer
    if backend.padding is None and backend.truncation is None:
        return backend
    plain = Tokenizer.from_str(backend.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


def bad_word_sequences(
    tokenizer: PreTrainedTokenizerBase, words: Sequence[str], backend: Tokenizer | None = None
) -> list[list[int]]:
    """Each bad word's token ids as vLLM finds them: the word as written at the start of a text, and again
    after a space (the same word inside a text) where that gives as many tokens, the first a new one.
    `backend`: the tokenizer's plain_backend, where the caller keeps one."""
    # in one batch through the Rust tokenizer, which lets go of the GIL while it works (and is faster than a
    # call a word): the scheduler's loop runs beside it
    backend = backend or plain_backend(tokenizer)
    stripped = [w.lstrip() for w in words]
    alone_all = backend.encode_batch(stripped, add_special_tokens=False)
    spaced_all = backend.encode_batch([" " + w for w in stripped], add_special_tokens=False)
    sequences: list[list[int]] = []
    for alone, spaced in zip((e.ids for e in alone_all), (e.ids for e in spaced_all)):
        sequences.append(alone)
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return [s for s in sequences if s]


class TokenMaskMatcher:
    """The part of xgrammar's GrammarMatcher the scheduler calls: tokens allowed by a fixed set (None: all),
    less each bad word's last token where the output so far ends with the rest of that word (vLLM looks
    at the output only, not the prompt)."""

    def __init__(
        self,
        vocab_size: int,
        allowed: Sequence[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
        output: Sequence[int] = (),
    ) -> None:
        bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
        if allowed is None:
            bits[:vocab_size] = 1
        else:
            bits[np.asarray(allowed, dtype=np.int64)] = 1
        # xgrammar's layout: 32-bit words, token t at bit t % 32 of word t // 32
        self._row = np.packbits(bits, bitorder="little").view(np.uint32)
        self._allowed = None if allowed is None else frozenset(allowed)
        # the words' last tokens by the length of the rest and the rest: a lookup for each length, not a
        # pass over every word, at each of a request's tokens
        self._bad: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for w in bad_words:
            self._bad.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), set()).add(w[-1])
        self._output = list(output)

    @property
    def follows_output(self) -> bool:
        """Whether the mask depends on the output so far (bad words do; a set of allowed tokens does not)."""
        return bool(self._bad)

    def _banned(self) -> set[int]:
        """The bad words' last tokens that may not come next: a word's ends the output as it stands."""
        out, banned = self._output, set()
        for before, words in self._bad.items():
            if len(out) >= before:
                banned |= words.get(tuple(out[len(out) - before :]), set())
        return banned

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = self._row
        if banned := self._banned():
            row = row.copy()
            for t in banned:
                row[t // 32] &= ~np.uint32(1 << (t % 32))
        bitmask[index].copy_(torch.from_numpy(row.view(np.int32)))

    def accept_token(self, token_id: int) -> bool:
        if (self._allowed is not None and token_id not in self._allowed) or token_id in self._banned():
            return False
        self._output.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False  # a mask ends nothing: EOS, a stop token or max_tokens does

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self._output[-num_tokens:]
