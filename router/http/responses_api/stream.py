"""A streamed response as the Responses API's events, from the chat stream's chunks: response.created
and response.in_progress; then per output item, in order, response.output_item.added, its deltas
(response.content_part.added, then response.reasoning_text.delta or response.output_text.delta; or
response.function_call_arguments.delta), their .done events and response.output_item.done; then
response.completed (response.incomplete at max_output_tokens; after a failure an error event, the open
item closed incomplete, and response.failed). A stream its client leaves is stored as it stands,
incomplete."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from router.http.chat_bridge import cached_of, sse_event
from router.http.responses_api.output import (
    ResponseHead,
    failure_code,
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    reasoning_text,
    status_of,
    usage,
)


class ResponseEvents:
    """One stream's events, numbered; `finished(body)` is awaited with the final response (to store it)."""

    def __init__(self, head: ResponseHead, count_tokens: Callable[[str], int], finished=None) -> None:
        self.head, self.count_tokens, self.finished = head, count_tokens, finished
        self.seq = 0
        self.output: list[dict] = []  # the items done so far
        self.open: tuple[str, str, list[str]] | None = None  # the item streaming: (kind, id, its text so far)
        self.reasoning = ""
        self.ended = False  # a final response was made (and handed to `finished`)

    def _event(self, name: str, **fields) -> str:
        event = {"type": name, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(name, event)

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.head.body("in_progress", []))
        yield self._event("response.in_progress", response=self.head.body("in_progress", []))
        finish, used = None, None
        async for chunk in chunks:
            if "error" in chunk:
                for event in self._close("incomplete", failed=True):
                    yield event
                error = chunk["error"]
                code = failure_code(error)
                yield self._event("error", code=code, message=error["message"], param=error["param"])
                failed = self.head.body("failed", self.output, error={"code": code, "message": error["message"]})
                await self._end(failed)  # kept, as OpenAI keeps a failed response
                yield self._event("response.failed", response=failed)
                async for _ in chunks:  # what is left: the chat stream's end
                    pass
                return
            if chunk.get("usage") is not None and not chunk["choices"]:
                used = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                for event in self._delta(delta):
                    yield event
                finish = choice.get("finish_reason") or finish
        status, incomplete = status_of(finish)
        for event in self._close(status):
            yield event
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            # a message item where there is no call, as in the whole response (reasoning alone included):
            # output_text is always there to read
            for event in self._open("message") + self._close(status):
                yield event
        done = self.head.body(
            status,
            self.output,
            usage(
                used["prompt_tokens"] if used else 0,
                used["completion_tokens"] if used else 0,
                self.count_tokens(self.reasoning),
                cached_of(used) if used else 0,
            ),
            incomplete,
        )
        await self._end(done)
        yield self._event("response.incomplete" if incomplete else "response.completed", response=done)

    async def left(self) -> None:
        """Stores what a client that left mid-stream had been sent: response.created told it the id, which
        a GET or a previous_response_id may name. Nothing, where the stream ended or never began."""
        if self.ended or self.seq == 0:
            return
        self._close("incomplete", failed=True)
        await self._end(self.head.body("incomplete", self.output))

    async def _end(self, body: dict) -> None:
        self.ended = True  # before the store is awaited: a client that leaves meanwhile keeps this body
        if self.finished is not None:
            await self.finished(body)

    def _delta(self, delta: dict) -> list[str]:
        events = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            text = delta.get(key)
            if not text:
                continue
            if self.open is None or self.open[0] != kind:
                events += self._close() + self._open(kind)
            _, item_id, parts = self.open
            parts.append(text)
            index = len(self.output)
            if kind == "reasoning":
                self.reasoning += text
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        delta=text,
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
                )
        for call in delta.get("tool_calls") or []:
            events += self._close()
            item_id, index = new_id("fc"), len(self.output)
            item = function_call_item(item_id, call, "completed")
            arguments = item["arguments"]
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=function_call_item(item_id, call, "in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments
                ),
                self._event(
                    "response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=arguments
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
            self.output.append(item)
        return events

    def _open(self, kind: str) -> list[str]:
        item_id, index = new_id("rs" if kind == "reasoning" else "msg"), len(self.output)
        self.open = (kind, item_id, [])
        if kind == "reasoning":
            item, part = reasoning_item(item_id, None, "in_progress"), reasoning_text("")
        else:
            item, part = message_item(item_id, None, "in_progress"), output_text("")
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part),
        ]

    def _close(self, status: str = "completed", failed: bool = False) -> list[str]:
        """Closes the item streaming: a message with the response's status; reasoning completed (as in
        the whole response), unless the stream failed inside it."""
        if self.open is None:
            return []
        kind, item_id, parts = self.open
        text, index = "".join(parts), len(self.output)
        self.open = None
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == "reasoning":
            item, part = reasoning_item(item_id, text, "incomplete" if failed else "completed"), reasoning_text(text)
            done = self._event("response.reasoning_text.done", **at, text=text)
        else:
            item, part = message_item(item_id, text, status), output_text(text)
            done = self._event("response.output_text.done", **at, text=text, logprobs=[])
        events = [done, self._event("response.content_part.done", **at, part=part)]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]
