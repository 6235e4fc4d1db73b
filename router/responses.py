"""OpenAI response bodies for completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

import json
import time

from router.generation import Piece


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Formatter:
    """Builds one request's bodies; `chat` picks the chat.completion shapes."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer, top_logprobs: int | None) -> None:
        self.id, self.model, self.chat, self.tok = request_id, model, chat, tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.created = int(time.time())
        self.offset = 0
        head = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": self.model}
        self._sse_head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": ['

    def _token(self, t: int) -> str:
        return self.tok.decode([t])

    def logprobs(self, piece: Piece) -> dict | None:
        if self.top_logprobs is None or not piece.logprobs:
            return None
        if self.chat:
            return {"content": [
                {"token": self._token(t), "logprob": lp, "bytes": list(self._token(t).encode()),
                 "top_logprobs": [{"token": self._token(i), "logprob": v, "bytes": list(self._token(i).encode())}
                                  for i, v in top]}
                for t, lp, top in zip(piece.token_ids, piece.logprobs, piece.top_logprobs)]}
        tokens = [self._token(t) for t in piece.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": piece.logprobs,
                "top_logprobs": [self._top_dict(top) for top in piece.top_logprobs],
                "text_offset": offsets}

    def _top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, v in top:  # most likely first: where two tokens decode alike, the likelier one stays
            out.setdefault(self._token(i), v)
        return out

    def whole(self, pieces: list[Piece], prompt_tokens: int) -> dict:
        text = "".join(p.text for p in pieces)
        merged = Piece(text, [t for p in pieces for t in p.token_ids], [x for p in pieces for x in p.logprobs],
                       [x for p in pieces for x in p.top_logprobs], pieces[-1].finish_reason if pieces else "stop")
        choice = {"index": 0, "logprobs": self.logprobs(merged), "finish_reason": merged.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(prompt_tokens, len(merged.token_ids))}

    def chunk(self, piece: Piece | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if piece is not None and (piece.text or not first):
                delta["content"] = piece.text
            if piece is not None and piece.finish_reason is not None and not piece.text:
                delta = {}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece.text if piece else ""}
        choice["logprobs"] = self.logprobs(piece) if piece is not None else None
        choice["finish_reason"] = piece.finish_reason if piece is not None else None
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def chunk_sse(self, piece: Piece) -> str:
        """`sse(self.chunk(piece))`, built from this request's fixed head: a streamed token's only
        per-token work here is encoding its text (the router does this for every token it streams)."""
        if self.top_logprobs is not None:
            return sse(self.chunk(piece))
        text, reason = json.dumps(piece.text, ensure_ascii=False), json.dumps(piece.finish_reason)
        if not self.chat:
            choice = '{"index": 0, "text": ' + text
        elif piece.finish_reason is not None and not piece.text:
            choice = '{"index": 0, "delta": {}'
        else:
            choice = '{"index": 0, "delta": {"content": ' + text + "}"
        return self._sse_head + choice + ', "logprobs": null, "finish_reason": ' + reason + "}]}\n\n"

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}
