"""A streamed message as Anthropic's events, from the chat stream's chunks: message_start; per content
block content_block_start, its content_block_delta events (thinking_delta, text_delta,
input_json_delta) and content_block_stop; then message_delta (stop_reason, the whole usage) and
message_stop; an error event after a failure."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from router.http.chat_bridge import cached_of, sse_event
from router.http.errors import anthropic_error_body
from router.http.messages_api.output import message_body, tool_use_id, usage

_STATUS_OF_CODE = {"invalid_request_error": 400, "rate_limit_error": 429, "service_unavailable": 503}


class MessageEvents:
    def __init__(
        self, message_id: str, model: str, input_tokens: int, stop_of: Callable[[str | None, list[int]], tuple]
    ) -> None:
        self.id, self.model, self.input_tokens, self.stop_of = message_id, model, input_tokens, stop_of
        self.index = -1
        self.open: str | None = None  # the kind of block streaming

    def _event(self, name: str, **fields) -> str:
        return sse_event(name, {"type": name, **fields})

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        yield self._event(
            "message_start", message=message_body(self.id, self.model, [], (None, None), usage(self.input_tokens, 0))
        )
        finish, used, ids = None, None, []
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                code = error.get("code")
                status = code if isinstance(code, int) else _STATUS_OF_CODE.get(error.get("type"), 500)
                yield sse_event("error", anthropic_error_body(status, error["message"]))
                async for _ in chunks:  # the chat stream's end
                    pass
                return
            if chunk.get("usage") is not None and not chunk["choices"]:
                used = chunk["usage"]
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
                for event in self._delta(choice.get("delta") or {}):
                    yield event
                finish = choice.get("finish_reason") or finish
        if self.index < 0:
            for event in self._start("text", {"type": "text", "text": ""}):
                yield event
        for event in self._stop():
            yield event
        stop = self.stop_of(finish, ids)
        # the whole usage, as Anthropic's message_delta carries it: what the prefix cache served is known
        # only now (message_start counted the prompt as computed)
        if used:
            final = usage(used["prompt_tokens"], used["completion_tokens"], cached_of(used))
        else:
            final = usage(self.input_tokens, len(ids))
        yield self._event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=final)
        yield self._event("message_stop")

    def _delta(self, delta: dict) -> list[str]:
        events = []
        for kind, key, name in (("thinking", "reasoning_content", "thinking_delta"), ("text", "content", "text_delta")):
            text = delta.get(key)
            if not text:
                continue
            if self.open != kind:
                start = (
                    {"type": "thinking", "thinking": "", "signature": ""}
                    if kind == "thinking"
                    else {"type": "text", "text": ""}
                )
                events += self._start(kind, start)
            field = "thinking" if kind == "thinking" else "text"
            events.append(self._event("content_block_delta", index=self.index, delta={"type": name, field: text}))
        for call in delta.get("tool_calls") or []:
            block = {"type": "tool_use", "id": tool_use_id(call), "name": call["function"]["name"], "input": {}}
            events += self._start("tool_use", block)
            partial = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
            events.append(self._event("content_block_delta", index=self.index, delta=partial))
            events += self._stop()
        return events

    def _start(self, kind: str, block: dict) -> list[str]:
        events = self._stop()
        self.index += 1
        self.open = kind
        return events + [self._event("content_block_start", index=self.index, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]
