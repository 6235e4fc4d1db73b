"""A chat choice's text as the assistant message it holds: reasoning first (router/chat/reasoning.py), then
the answer's content and tool calls (router/chat/tool_calls.py), piece by piece as it streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.chat.reasoning import ReasoningParser
from router.chat.tool_calls import ToolCall, tool_call_parser


@dataclass
class ChatParts:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatParts) -> ChatParts:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class ChatOutput:
    """How a request's chat choices are read: whether with a reasoning parser (and whether the prompt
    left them inside a think block), and in which tool-call format (None: no tool calls)."""

    reasoning: bool = False
    starts_in_reasoning: bool = False
    tool_calls: str | None = None
    max_calls: int | None = None  # 1 for parallel_tool_calls false: later calls are dropped
    # a call the output cut short (max_tokens) returned as content, its markup and all, as chat's is (and
    # vLLM's); off for the Responses and Messages APIs, whose items have no place for it
    unfinished_calls_as_text: bool = True
    # include_reasoning false (vLLM's): the reasoning is still parsed out of the answer, but not returned
    shows_reasoning: bool = True

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tool_calls is not None

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(
            ReasoningParser(self.starts_in_reasoning) if self.reasoning else None,
            tool_call_parser(self.tool_calls) if self.tool_calls else None,
            self.max_calls,
            self.unfinished_calls_as_text,
            self.shows_reasoning,
        )


class ChatOutputParser:
    """One choice: feed its text pieces, then finish; the parts given out add up to the whole message,
    however the text was split."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools,
        max_calls: int | None = None,
        keep_unfinished: bool = True,
        shows_reasoning: bool = True,
    ) -> None:
        self._reasoning, self._tools, self._max_calls = reasoning, tools, max_calls
        self._keep_unfinished, self._shows_reasoning = keep_unfinished, shows_reasoning
        self.calls = 0  # tool calls given out so far (the next one's index in a stream)

    def feed(self, text: str) -> ChatParts:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._answer(reasoning, content, final=False)

    def finish(self) -> ChatParts:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatParts:
        parts = ChatParts(reasoning if self._shows_reasoning else "")
        if self._tools is None:
            parts.content = content
        else:
            parts.content, parts.tool_calls = self._tools.feed(content)
            if final:
                rest, calls = self._tools.finish(self._keep_unfinished)
                parts.content += rest
                parts.tool_calls += calls
        if self._max_calls is not None:  # an unconstrained model may call more often than the client allows
            parts.tool_calls = parts.tool_calls[: max(self._max_calls - self.calls, 0)]
        self.calls += len(parts.tool_calls)
        return parts


def message(parts: ChatParts, output: ChatOutput) -> dict:
    """The assistant message of a whole choice. Its content is None when it has tool calls or reasoning
    and no text besides, as OpenAI's and vLLM's are."""
    empty = not parts.content and (parts.tool_calls or parts.reasoning)
    msg: dict = {"role": "assistant", "content": None if empty else parts.content}
    if output.reasoning and output.shows_reasoning:
        msg["reasoning_content"] = parts.reasoning or None
    if parts.tool_calls:
        msg["tool_calls"] = [c.as_openai() for c in parts.tool_calls]
    return msg


def delta(parts: ChatParts, first_call: int) -> dict:
    """A stream chunk's delta of these parts; the tool calls are numbered from first_call."""
    out: dict = {}
    if parts.reasoning:
        out["reasoning_content"] = parts.reasoning
    if parts.content:
        out["content"] = parts.content
    if parts.tool_calls:
        out["tool_calls"] = [c.as_openai(first_call + i) for i, c in enumerate(parts.tool_calls)]
    return out
