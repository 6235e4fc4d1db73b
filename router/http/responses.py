"""OpenAI response bodies for completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from router.chat.output import ChatOutput, ChatOutputParser, ChatParts, deltas, message
from router.http.extras import Extras, prompt_logprobs_list
from router.http.token_bytes import TextOffsets, token_bytes
from router.replicas.generation import Piece

# An SSE line ends at CR or LF only, but str.splitlines (and so httpx's iter_lines) also ends one at NEL,
# LINE SEPARATOR and PARAGRAPH SEPARATOR, which JSON carries unescaped. A stream escapes them, so that
# a client reading it line by line never gets an event cut in two by a token's text. The other line
# ends splitlines knows are control characters, which JSON always escapes.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def stream_json(value) -> str:
    """JSON for an SSE event: UTF-8 text as it is, save the line ends above."""
    return json.dumps(value, ensure_ascii=False).translate(_LINE_ENDS)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else stream_json(data)}\n\n"


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: of the prompt tokens, those served from the prefix cache."""
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


@dataclass(frozen=True)
class PromptShown:
    """What a response may show of one of its prompts: its token ids, and its text when the request
    echoes it (a completion's echo: the prompt before each choice's text)."""

    token_ids: list[int]
    echo: str | None = None  # as the client sent it (its decoded ids when it sent token ids)


class Formatter:
    """Builds one request's bodies; `chat` picks the chat.completion shapes, `n` is the choices of each
    of its `prompts` (several in a completion: choice i of prompt p has index p * n + i), and `output`
    how a chat choice's text is read (reasoning, tool calls; None: all of it is content)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        tokenizer,
        top_logprobs: int | None,
        n: int = 1,
        prompts: list[PromptShown] | None = None,
        output: ChatOutput | None = None,
        extras: Extras = Extras(),
    ) -> None:
        self.id, self.model, self.chat, self.tok = request_id, model, chat, tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.n, self.prompts, self.extras = n, prompts or [PromptShown([])], extras
        self.choices = n * len(self.prompts)
        self.output = output if chat and output is not None and output.parses else None
        self._parsers: dict[int, ChatOutputParser] = {}  # a streamed choice's, by index
        self.created = int(time.time())
        self.token_bytes = token_bytes(tokenizer) if tokenizer is not None else None  # logprobs need the tokenizer
        self.offsets = [TextOffsets() for _ in range(self.choices)]  # each choice's text_offset so far
        self.generated = [0] * self.choices  # each choice's tokens streamed so far (continuous usage)
        head = {
            "id": self.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        self._sse_head = "data: " + stream_json(head)[:-1] + ', "choices": ['

    def _token(self, t: int) -> str:
        return f"token_id:{t}" if self.extras.tokens_as_ids else self.token_bytes.text(t)

    def prompt(self, piece: Piece) -> PromptShown:
        """The prompt of piece's choice."""
        return self.prompts[piece.index // self.n]

    def echoes(self, piece: Piece) -> bool:
        return piece.first and self.prompt(piece).echo is not None

    def text(self, piece: Piece) -> str:
        """The piece's text, after the prompt when it is its choice's first and the request echoes."""
        return self.prompt(piece).echo + piece.text if self.echoes(piece) else piece.text

    def logprobs(self, piece: Piece) -> dict | None:
        if self.top_logprobs is None or not (piece.logprobs or self.echoes(piece)):
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(t),
                        "logprob": lp,
                        "bytes": list(self.token_bytes.of(t)),
                        "top_logprobs": [
                            {"token": self._token(i), "logprob": v, "bytes": list(self.token_bytes.of(i))}
                            for i, v in top
                        ],
                    }
                    for t, lp, top in zip(piece.token_ids, piece.logprobs, piece.top_logprobs)
                ]
            }
        ids, values = list(piece.token_ids), list(piece.logprobs)
        tops = [self._top_dict(t, lp, top) for t, lp, top in zip(ids, values, piece.top_logprobs)]
        echoed = 0  # the echoed prompt's tokens: its text keeps their special tokens, whatever the output skips
        if self.echoes(piece):
            prompt_values, prompt_tops = self._prompt_logprobs(piece)
            echoed = len(self.prompt(piece).token_ids)
            ids, values, tops = self.prompt(piece).token_ids + ids, prompt_values + values, prompt_tops + tops
        skip, offsets = self.extras.skip_special_tokens, self.offsets[piece.index]
        return {
            "tokens": [self._token(t) for t in ids],
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": [offsets.add(self.token_bytes.shown(t, skip and i >= echoed)) for i, t in enumerate(ids)],
        }

    def _prompt_logprobs(self, piece: Piece) -> tuple[list[float | None], list[dict | None]]:
        """The echoed prompt's token_logprobs and top_logprobs: none for its first token (nothing comes
        before it), nor for any the replica did not score."""
        prompt = self.prompt(piece).token_ids
        scored = list(piece.prompt_logprobs or [])[: len(prompt) - 1]
        scored += [None] * (len(prompt) - 1 - len(scored))
        # prompt_logprobs may have asked the replica for more of the most likely than logprobs shows
        return (
            [None] + [s[0] if s else None for s in scored],
            [None] + [self._top_dict(t, s[0], s[1]) if s else None for t, s in zip(prompt[1:], scored)],
        )

    def _top_dict(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, float]:
        """A completion's top_logprobs at one position: the k most likely and the token itself, which
        may make k + 1, as OpenAI's legacy completions and vLLM's return them (with logprobs 0, the
        token alone)."""
        out: dict[str, float] = {}
        for i, v in top[: self.top_logprobs]:  # keys differ but where two added tokens share a text
            out.setdefault(self._token(i), v)
        out.setdefault(self._token(token), logprob)
        return out

    def whole(self, pieces: list[Piece], prompt_tokens: int, cached_tokens: int | None = None) -> dict:
        choices = [self._whole_choice(i, [p for p in pieces if p.index == i]) for i in range(self.choices)]
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, sum(len(p.token_ids) for p in pieces), cached_tokens),
        }
        if self.chat:  # vLLM's: the prompt's fields on the response, chat having one prompt
            if self.extras.return_token_ids:
                body["prompt_token_ids"] = self.prompts[0].token_ids
            if self.extras.prompt_logprobs is not None:
                body["prompt_logprobs"] = choices[0].pop("prompt_logprobs", None) if choices else None
                for choice in choices:
                    choice.pop("prompt_logprobs", None)
        return body

    def _whole_choice(self, index: int, own: list[Piece]) -> dict:
        merged = Piece(
            "".join(p.text for p in own),
            [t for p in own for t in p.token_ids],
            [x for p in own for x in p.logprobs],
            [x for p in own for x in p.top_logprobs],
            own[-1].finish_reason if own else "stop",
            index,
            first=True,
            prompt_logprobs=own[0].prompt_logprobs if own else None,
        )
        choice = {"index": index, "logprobs": self.logprobs(merged), "finish_reason": merged.finish_reason}
        prompt = self.prompt(merged).token_ids
        if self.extras.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_list(
                prompt, merged.prompt_logprobs, self.extras.prompt_logprobs, self._token
            )
        if self.extras.return_token_ids:
            choice["token_ids"] = merged.token_ids
            if not self.chat:
                choice["prompt_token_ids"] = prompt
        if self.output is not None:
            parser = self.output.parser()
            parts = parser.feed(merged.text)
            parts += parser.finish(cut=merged.finish_reason == "length")
            choice["message"] = message(parts, self.output)
            choice["finish_reason"] = _finish_reason(merged.finish_reason, parser)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": merged.text}
        else:
            choice["text"] = self.text(merged)
        return choice

    def chunk(self, piece: Piece | None, first: bool = False, index: int = 0) -> dict:
        """A stream chunk of piece (None: an empty one; `first`: chat's role chunk of choice `index`)."""
        index = piece.index if piece is not None else index
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if piece is not None and (piece.text or not first):
                delta["content"] = piece.text
            if piece is not None and piece.finish_reason is not None and not piece.text:
                delta = {}
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": self.text(piece) if piece else ""}
        choice["logprobs"] = self.logprobs(piece) if piece is not None else None
        choice["finish_reason"] = piece.finish_reason if piece is not None else None
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _parsed(self, piece: Piece) -> tuple[list[dict], str | None]:
        """What the choice's parser gives out of piece's text, as chunks' deltas (reasoning, content and
        tool calls numbered within the choice, each only when there is some; more than one where text follows
        a call), and the finish reason."""
        parser = self._parsers.get(piece.index)
        if parser is None:
            parser = self._parsers[piece.index] = self.output.parser()
        first_call = parser.calls
        parts: ChatParts = parser.feed(piece.text)
        reason = piece.finish_reason
        if reason is not None:
            parts += parser.finish(cut=reason == "length")
            reason = _finish_reason(reason, parser)
        return deltas(parts, first_call), reason

    def _delta_chunk(self, index: int, delta: dict) -> dict:
        """A chunk of a delta alone (one before the piece's own, which carries the piece's token ids and
        logprobs); with continuous usage, the usage so far, as every chunk has it."""
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        body["choices"] = [choice]
        if self.extras.continuous_usage:
            body["usage"] = usage(len(self.prompts[index // self.n].token_ids), self.generated[index])
        return body

    def role_chunks(self) -> list[str]:
        """Chat's first events: one per choice, naming the assistant's role."""
        return [sse(self._with_extras(self.chunk(None, first=True, index=i), None, i)) for i in range(self.choices)]

    def _with_extras(self, body: dict, piece: Piece | None, index: int) -> dict:
        """A stream chunk with the fields the request's extras add (`piece` None: chat's role chunk,
        which carries a chat prompt's token ids, as vLLM's first chunk does)."""
        choice, extras = body["choices"][0], self.extras
        prompt = self.prompts[index // self.n].token_ids
        if extras.return_token_ids:
            if piece is not None:
                choice["token_ids"] = piece.token_ids
            if piece is None:
                body["prompt_token_ids"] = prompt
            elif piece.first and not self.chat:
                choice["prompt_token_ids"] = prompt
        if extras.continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
            body["usage"] = usage(len(prompt), self.generated[index])
        return body

    def chunk_sse(self, piece: Piece) -> str:
        """`sse(self.chunk(piece))`, built from this request's fixed head: a streamed token's only
        per-token work here is encoding its text (the router does this for every token it streams).
        "" when there is nothing to send: a parser holds the piece's text back (it may open a tool call)."""
        reason, extras = piece.finish_reason, self.extras
        self.generated[piece.index] += len(piece.token_ids)
        earlier = ""
        if self.output is not None:
            parsed, reason = self._parsed(piece)
            # text after a call: its own chunk after the call's; the piece's tokens, logprobs and reason
            # go with the last
            if len(parsed) > 1:
                earlier = "".join(sse(self._delta_chunk(piece.index, d)) for d in parsed[:-1])
            parsed = parsed[-1]
            ids_shown = extras.return_token_ids and piece.token_ids  # every token's id goes out
            if not parsed and reason is None and not piece.logprobs and not ids_shown:
                return earlier
            if self.top_logprobs is not None or parsed.keys() - {"content"} or extras.in_stream:
                choice = {
                    "index": piece.index,
                    "delta": parsed,
                    "logprobs": self.logprobs(piece),
                    "finish_reason": reason,
                }
                body = {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [choice],
                }
                return earlier + sse(self._with_extras(body, piece, piece.index))
            text = parsed.get("content", "")
        elif self.top_logprobs is not None or self.echoes(piece) or extras.in_stream:
            return sse(self._with_extras(self.chunk(piece), piece, piece.index))
        else:
            text = piece.text
        index = '{"index": ' + str(piece.index)
        if not self.chat:
            choice = index + ', "text": ' + stream_json(text)
        elif reason is not None and not text:
            choice = index + ', "delta": {}'
        else:
            choice = index + ', "delta": {"content": ' + stream_json(text) + "}"
        return (
            earlier + self._sse_head + choice + ', "logprobs": null, "finish_reason": ' + json.dumps(reason) + "}]}\n\n"
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }


def _finish_reason(reason: str | None, parser: ChatOutputParser) -> str | None:
    """OpenAI's "tool_calls" for a choice that stopped after making calls (one cut at max_tokens stays "length")."""
    return "tool_calls" if reason == "stop" and parser.calls else reason
