"""Incremental detokenization with stop strings: text is released as tokens arrive, never splitting a
multi-byte character (cluster/text.py's TextStream), and held back while it could be the start of a stop
string, so a stop that spans several tokens is still found and never shown. As vLLM's: the token that
ends a request (EOS, a stop_token_id) adds no text, and stop strings count only past min_tokens."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from cluster import TextStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stops: list[str],
        skip_special_tokens: bool = True,
        stop_token_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        prompt_ids: Sequence[int] = (),
        include_stops: bool = False,
    ) -> None:
        """`stop_token_ids`: the tokens that end a request (EOS, stop_token_ids), whose text is not the
        output's when they do (`add(..., ends=True)`); `min_tokens`: stop strings are looked for only in
        the text of the tokens past the first min_tokens, as vLLM does; `prompt_ids`: the request's prompt,
        whose last tokens the output is decoded behind (cluster/text.py: a first word keeps its space);
        `include_stops`: the stop string found, or the stop token that ended the request, stays in the text
        (vLLM's include_stop_str_in_output)."""
        self.stop_token_ids, self.min_tokens, self.include_stops = stop_token_ids, min_tokens, include_stops
        self._ids: list[int] = []
        self._released = ""
        self._stream = TextStream(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = self._stream.carried
        # where the text of the first min_tokens tokens ends (None: not yet): a stop counts only if it ends
        # past it, whatever the other stops hold back
        self._boundary: int | None = 0 if min_tokens == 0 else None
        self.stopped = False  # a stop string was found: nothing more is released

    def add(self, token_id: int, ends: bool = False) -> str:
        """Releases the text that token completes (possibly ""); `ends`: the request ended with it, a stop
        token whose text is left out."""
        if self.stopped:
            return ""
        if ends and token_id in self.stop_token_ids and not self.include_stops:
            return ""
        self._ids.append(token_id)
        self._pending += self._stream.step(token_id)
        if len(self._ids) == self.min_tokens:
            self._boundary = len(self._released) + len(self._pending)
        return self._release(self._hold)

    def _release(self, keep: int) -> str:
        found: list[tuple[int, str]] = []
        if self._boundary is not None:
            # in pending's own offsets: a stop must end past the boundary (none can at its own token)
            start = self._boundary - len(self._released)
            found = [(self._pending.find(s, max(0, start - len(s) + 1)), s) for s in self.stops]
        # the earliest stop (the first listed of those found there)
        cut, stop = min(((i, s) for i, s in found if i >= 0), key=lambda f: f[0], default=(-1, ""))
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[: cut + len(stop) if self.include_stops else cut], ""
        else:
            keep = min(keep, len(self._pending))
            out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        self._released += out
        return out

    def flush(self) -> str:
        """The rest, once the request has ended: held-back text, and bytes of an unfinished character
        (shown as U+FFFD, as a whole decode shows them)."""
        if self.stopped:
            return ""
        whole = self._stream.whole(self._ids)
        seen = self._released + self._pending
        if whole.startswith(seen):
            self._pending += whole[len(seen) :]
        else:  # a stray byte changed text already released: the stream's own end
            self._pending += self._stream.rest()
        return self._release(0)
