"""Serving another API's request as the chat completion it translates into: the chat path's prompt,
grammar, output reading and serving run unchanged, and its result comes back as the chat.completion
body, or as its stream's chunks, for the Responses and Messages APIs to write in their own shapes."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from router.chat.prepare import prepare_chat
from router.http.errors import APIError, validation_error
from router.http.extras import Extras
from router.http.protocol import ChatCompletionRequest
from router.http.responses import Formatter, PromptShown, stream_json
from router.http.serving import PromptRun, serve
from router.http.state import RouterState


@dataclass
class ChatResult:
    """A chat request's outcome: `body` (the chat.completion) or, streamed, `response` (the SSE
    response already serving it) and `chunks` (its chat.completion.chunk bodies; an error ends
    them as {"error": {...}}), to be rewritten with `restream`."""

    prompt_ids: list[int]
    body: dict | None = None
    response: StreamingResponse | None = None
    chunks: AsyncIterator[dict] | None = None

    def restream(
        self,
        events: Callable[[AsyncIterator[dict]], AsyncIterator[str]],
        left: Callable[[], Awaitable[None]] | None = None,
    ) -> StreamingResponse:
        """The stream, its chunks rewritten by events (what ends it, however it ends, stays); `left` is
        awaited once it is over, however it ended (a client that leaves stops events where they are)."""
        self.response.body_iterator = events(self.chunks)
        if left is not None:
            self.response.then(left)
        return self.response


def chat_request(fields: dict) -> ChatCompletionRequest:
    """The chat request a translation wrote (its errors are the translation's: a 400 either way)."""
    sent = {k: v for k, v in fields.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(sent)
    except ValidationError as e:
        where, msg = validation_error(e.errors(), sent)
        raise APIError(400, f"{where}: {msg}", param=where or None) from e


def prompt_ids(state: RouterState, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, as the chat path renders it (count_tokens)."""
    return prepare_chat(state, req, counting=True).ids


async def run_chat(state: RouterState, request: Request, req: ChatCompletionRequest) -> ChatResult:
    """Serves req as /v1/chat/completions does; the output's token ids come with it (a stop reason
    is read from the last of them)."""
    chat = prepare_chat(state, req)
    params = state.sampling_params(
        req,
        chat.ids,
        req.max_completion_tokens,
        None,
        None,
        grammar=chat.grammar,
        max_tokens_field="max_completion_tokens",
    )
    fmt = Formatter(
        f"chatcmpl-{uuid.uuid4().hex}",
        state.model_name,
        True,
        state.tokenizer,
        None,
        params.n,
        [PromptShown(chat.ids)],
        # a call cut short is no item of these APIs: its markup is not shown as text either; their items
        # follow the order of the text and calls (the message's IN_ORDER)
        output=dataclasses.replace(chat.output, unfinished_calls_as_text=False, keeps_order=True),
        extras=Extras(return_token_ids=True),
    )
    result = await serve(state, request, req, [PromptRun(chat.ids, params)], fmt)
    if not req.stream:
        return ChatResult(chat.ids, body=result)
    return ChatResult(chat.ids, response=result, chunks=_chunks(result.body_iterator))


async def _chunks(events: AsyncIterator[str]) -> AsyncIterator[dict]:
    async for text in events:
        for event in text.split("\n\n"):
            if event.startswith("data: ") and event != "data: [DONE]":
                yield json.loads(event[len("data: ") :])


def sse_event(name: str, data: dict) -> str:
    """An SSE event with its name (both APIs name theirs; the clients dispatch on it)."""
    return f"event: {name}\ndata: {stream_json(data)}\n\n"


@dataclass
class Origins:
    """Where each message of a translated chat request came from in the API's own request, so that an error
    the chat path names by a message (`messages.3.tool_calls`) names the API's field instead: `of[i]` for
    message i (its item, or the field that stands for it: instructions, system, previous_response_id), and
    `calls[i]` for its calls where they came from elsewhere (a function_call item, a tool_use block)."""

    of: list[str] = field(default_factory=list)
    calls: dict[int, str] = field(default_factory=dict)

    def add(self, where: str, calls_at: str | None = None) -> None:
        if calls_at is not None:
            self.calls[len(self.of)] = calls_at
        self.of.append(where)

    def prepend(self, where: str) -> None:
        self.of.insert(0, where)
        self.calls = {i + 1: at for i, at in self.calls.items()}

    def named(self, error: APIError) -> APIError:
        if error.param is not None:
            error.param = self._name(error.param)
        error.message = self._name(error.message)
        return error

    def _name(self, text: str) -> str:
        found = re.match(r"messages\.(\d+)(\.tool_calls)?", text)
        if found is None or not _starts_with_name(text, found.group(0)) or int(found.group(1)) >= len(self.of):
            return text
        i, rest = int(found.group(1)), text[found.end() :]
        if found.group(2):
            return self.calls[i] + rest if i in self.calls else self.of[i] + rest
        return self.of[i] + rest


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """error with the chat fields it names written as the API's own (`names`: chat's -> the API's; a `*`
    in both stands for the same list index)."""
    for old, new in names.items():
        if error.param is not None:
            error.param = _rename(error.param, old, new)
        error.message = _rename(error.message, old, new)
    return error


def _rename(text: str, old: str, new: str) -> str:
    """text with the field name `old` at its start written as `new`."""
    if "*" in old:
        found = re.match(re.escape(old).replace(r"\*", r"(\d+)"), text)
        if found is None or not _starts_with_name(text, found.group(0)):
            return text
        return new.replace("*", found.group(1)) + text[found.end() :]
    return new + text[len(old) :] if _starts_with_name(text, old) else text


def _starts_with_name(text: str, name: str) -> bool:
    """Whether text begins with the field name `name` whole ("stop: ..." or "stop.0", not "stop_sequences")."""
    after = text[len(name) : len(name) + 1]
    return text.startswith(name) and not (after.isalnum() or after == "_")


def cached_of(used: dict) -> int:
    """The prompt tokens a chat completion's usage says the prefix cache served."""
    return (used.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
