"""A chat choice's text as the assistant message it holds: reasoning first (router/chat/reasoning.py), then
the answer's content and tool calls (router/chat/tool_calls.py), piece by piece as it streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.chat.reasoning import ReasoningParser
from router.chat.tool_calls import ToolCall, add_segment, split_segments, tool_call_parser

# a whole message's key, where ChatOutput.keeps_order, for its content's text and its calls (as indices into
# tool_calls) in the order the model wrote them
IN_ORDER = "in_order"


@dataclass
class ChatParts:
    reasoning: str = ""
    # the answer's text and its calls in the order the model wrote them (text after a call is an item of its
    # own in the Responses and Messages APIs); chat's content and tool_calls are read from it
    in_order: list[str | ToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        return split_segments(self.in_order)[0]

    @property
    def tool_calls(self) -> list[ToolCall]:
        return split_segments(self.in_order)[1]

    def __iadd__(self, other: ChatParts) -> ChatParts:
        self.reasoning += other.reasoning
        for segment in other.in_order:
            add_segment(self.in_order, segment)
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.in_order)


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
    # a whole message also says the order of its text and calls (IN_ORDER), for the APIs of items
    keeps_order: bool = False

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

    def finish(self, cut: bool = False) -> ChatParts:
        """The choice's end; `cut`: by its token limit (a call's opening tag it cut short is then dropped,
        where unfinished calls are not kept)."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, content, final=True, cut=cut)

    def _answer(self, reasoning: str, content: str, final: bool, cut: bool = False) -> ChatParts:
        reasoning = reasoning if self._shows_reasoning else ""
        if self._tools is None:
            return ChatParts(reasoning, [content] if content else [])
        segments = self._tools.feed_in_order(content)
        if final:
            for segment in self._tools.finish_in_order(self._keep_unfinished, cut):
                add_segment(segments, segment)
        if len(segments) == 1 and isinstance(segments[0], str):  # text alone, as most tokens are
            return ChatParts(reasoning, segments)
        if self._max_calls is not None:  # an unconstrained model may call more often than the client allows
            allowed = max(self._max_calls - self.calls, 0)
            kept: list[str | ToolCall] = []
            for s in segments:  # the text around a call dropped joins up, as a stream gives it
                if isinstance(s, str) or allowed > 0:
                    allowed -= not isinstance(s, str)
                    add_segment(kept, s)
            segments = kept
        self.calls += sum(isinstance(s, ToolCall) for s in segments)
        return ChatParts(reasoning, segments)


def message(parts: ChatParts, output: ChatOutput) -> dict:
    """The assistant message of a whole choice. Its content is None when it has tool calls or reasoning
    and no text besides, as OpenAI's and vLLM's are."""
    content, calls = split_segments(parts.in_order)
    empty = not content and (calls or parts.reasoning)
    msg: dict = {"role": "assistant", "content": None if empty else content}
    if output.reasoning and output.shows_reasoning:
        msg["reasoning_content"] = parts.reasoning or None
    if calls:
        msg["tool_calls"] = [c.as_openai() for c in calls]
    if output.keeps_order:
        index = {id(c): i for i, c in enumerate(calls)}
        msg[IN_ORDER] = [s if isinstance(s, str) else index[id(s)] for s in parts.in_order]
    return msg


def deltas(parts: ChatParts, first_call: int) -> list[dict]:
    """A stream's deltas of these parts, one or more (one with nothing where there is nothing): a delta holds
    text before calls, so text the model wrote after a call starts another; the tool calls are numbered from
    first_call."""
    segments = parts.in_order
    if not segments or (len(segments) == 1 and type(segments[0]) is str):  # text alone, as most tokens are
        d = {"reasoning_content": parts.reasoning} if parts.reasoning else {}
        return [{**d, "content": segments[0]} if segments else d]
    groups: list[list[str | ToolCall]] = [[]]
    for segment in parts.in_order:
        if isinstance(segment, str) and groups[-1] and isinstance(groups[-1][-1], ToolCall):
            groups.append([])
        groups[-1].append(segment)
    out = []
    for i, group in enumerate(groups):
        d: dict = {}
        if i == 0 and parts.reasoning:
            d["reasoning_content"] = parts.reasoning
        text, calls = split_segments(group)
        if text:
            d["content"] = text
        if calls:
            d["tool_calls"] = [c.as_openai(first_call + j) for j, c in enumerate(calls)]
        first_call += len(calls)
        out.append(d)
    return out
