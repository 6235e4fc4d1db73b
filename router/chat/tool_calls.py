"""Tool calls read from a model's output, as the text streams or whole (both give the same calls):
Qwen2.5 / Qwen3's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (any number of them)
and Llama 3.1's JSON `{"name": ..., "parameters": {...}}`. Text around the calls is content; a call
that does not parse stays content too."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from router.chat.markers import split_held


def tool_call_parser_for(setting: str, model_type: str | None) -> str | None:
    """The format a served model's calls are read in: the setting's, or for auto its model_type's."""
    if setting == "none":
        return None
    if setting == "auto":
        kind = (model_type or "").split("_")[0]
        return {"qwen2": "qwen", "qwen3": "qwen", "llama": "llama"}.get(kind)
    return setting


# what comes between two calls of one output, in each format (what the chat templates write, and the parsers
# skip)
CALL_SEPARATORS = {"qwen": "\n", "llama": "; "}


def written_calls(parser: str, calls: list[dict]) -> str:
    """Calls (as chat templates read them: a function's name and its arguments, a mapping or JSON text) in the
    text the model writes them in, which `parser` reads back: for a chat template that leaves an earlier
    turn's calls out of the prompt."""
    written = []
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = parse_arguments(arguments)
            except (ValueError, RecursionError):
                pass  # no JSON: written as a JSON string, so that the call's text stays JSON
        args = json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, str) else json_text(arguments)
        name = json.dumps(function["name"], ensure_ascii=False)
        if parser == "qwen":
            written.append(f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>')
        else:  # llama's bare JSON
            written.append(f'{{"name": {name}, "parameters": {args}}}')
    return CALL_SEPARATORS[parser].join(written)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: int | None = None) -> dict:
        """The message's tool_calls entry (with `index`: a stream delta's)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(body: str, arguments_key: str, tagged: bool) -> ToolCall | None:
    """The call a JSON object's text names, or None when it is not one. Untagged (Llama's bare JSON),
    an object is a call only with its arguments key, so that an answer's own JSON stays content."""
    try:
        value = parse_arguments(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        key = arguments_key if arguments_key in value else "arguments"
        if not tagged and key not in value:
            return None
        args = value.get(key, {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = parse_arguments(args)
        if not isinstance(args, dict):
            return None
        return ToolCall(value["name"], json_text(args))
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser recurses
        return None


@dataclass(frozen=True)
class JSONNumber:
    """A number with a fraction or an exponent, kept as written: 1e999, which a schema's grammar allows, is
    JSON, but as a float it would go out as Infinity, which is not; and 1e99999999999999999999 is beyond even
    a Decimal's exponents."""

    text: str


def parse_arguments(text: str) -> object:
    """text's JSON value, its numbers with a fraction or exponent as JSONNumbers (json_text writes them back as
    they were written). Python's parser also reads NaN and Infinity, which JSON has not: they are refused."""
    return json.loads(text, parse_constant=_not_json, parse_float=JSONNumber)


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def json_text(value: object) -> str:
    """value as JSON text, its JSONNumbers as they were written."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(json_text, value)) + "]"
    if isinstance(value, JSONNumber):
        return value.text
    return json.dumps(value, ensure_ascii=False)


def add_segment(segments: list[str | ToolCall], item: str | ToolCall) -> list[str | ToolCall]:
    """segments with `item` after them: text joins the text before it; empty text adds nothing."""
    if isinstance(item, str):
        if not item:
            return segments
        if segments and isinstance(segments[-1], str):
            segments[-1] += item
            return segments
    segments.append(item)
    return segments


def split_segments(segments: list[str | ToolCall]) -> tuple[str, list[ToolCall]]:
    """Segments as (their text, their calls), the order between the two let go (chat's message has no place
    for it)."""
    return "".join(s for s in segments if isinstance(s, str)), [s for s in segments if isinstance(s, ToolCall)]


class ToolCallParser:
    """One choice's content in pieces -> (content, calls) pieces. A subclass says where a call begins
    (`begin`), where its text ends, and what it names; whitespace (and `separators`) between calls and
    after the last one is dropped."""

    begin: str
    separators = " \t\r\n"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._after_call = False
        self.calls = 0  # calls found so far

    def _started(self) -> None:
        """A call's text begins at the buffer's start."""

    def _scan_from(self, pos: int) -> None:
        """A scan of a call's text for its end begins at `pos`, outside any JSON string; it goes on where it
        stopped, piece after piece."""
        self._pos, self._in_string, self._escaped = pos, False, False

    def _in_json_string(self, ch: str) -> bool:
        """Whether `ch`, the scan's next character, belongs to a JSON string (its quotes included), which
        the scan then leaves or enters as `ch` says."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
            return True
        self._in_string = ch == '"'
        return self._in_string

    def _end(self, text: str) -> int | None:
        """Where the call that `text` starts (with `begin`) ends, or None while it has not."""
        raise NotImplementedError

    def _parse(self, text: str) -> ToolCall | None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return split_segments(self.feed_in_order(text))

    def feed_in_order(self, text: str) -> list[str | ToolCall]:
        """The content and calls `text` completes, in the order the model wrote them."""
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if self._after_call:
                self._buffer = self._buffer.lstrip(self.separators)
                if not self._buffer:
                    return out
                self._after_call = False
            if not self._in_call:
                at = self._buffer.find(self.begin)
                if at < 0:
                    content, self._buffer = split_held(self._buffer, self.begin)
                    return add_segment(out, content)
                add_segment(out, self._buffer[:at])
                self._buffer, self._in_call = self._buffer[at:], True
                self._started()
            end = self._end(self._buffer)
            if end is None:
                return out
            call = self._parse(self._buffer[:end])
            if call is None:
                add_segment(out, self._buffer[:end])
            else:
                out.append(call)
                self.calls += 1
                self._after_call = True
            self._buffer, self._in_call = self._buffer[end:], False

    def finish(self, keep_unfinished: bool = True, cut: bool = False) -> tuple[str, list[ToolCall]]:
        return split_segments(self.finish_in_order(keep_unfinished, cut))

    def finish_in_order(self, keep_unfinished: bool = True, cut: bool = False) -> list[str | ToolCall]:
        """The end of the choice: a call still open is taken if its text parses whole (the output may
        end before a closing tag), otherwise it is content, or, not `keep_unfinished`, dropped (the
        format's markup of a call cut short, which an API of items has no place for). Outside a call what
        is held back, the start of an opening tag, is dropped too where the token limit `cut` it."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            if (call := self._parse(rest)) is not None:
                self.calls += 1
                return [call]
            return add_segment([], rest if keep_unfinished else "")
        return add_segment([], rest if keep_unfinished or not cut else "")


class QwenToolCallParser(ToolCallParser):
    begin, close = "<tool_call>", "</tool_call>"

    def _started(self) -> None:
        self._scan_from(len(self.begin))

    def _end(self, text: str) -> int | None:
        """Just past the first closing tag outside the JSON's strings (an argument may hold the tag's
        text: code, markup)."""
        for i in range(self._pos, len(text)):
            if self._in_json_string(text[i]) or text[i] != "<":
                continue
            if text.startswith(self.close, i):
                return i + len(self.close)
            if self.close.startswith(text[i:]):  # the tag may go on in the next piece
                self._pos = i
                return None
        self._pos = len(text)
        return None

    def _parse(self, text: str) -> ToolCall | None:
        body = text[len(self.begin) :]
        # the closing tag, or at the output's end (max_tokens) as much of it as was written
        cut = next((k for k in range(len(self.close), 0, -1) if body.endswith(self.close[:k])), 0)
        return _call(body[: len(body) - cut].strip(), "arguments", tagged=True)


class LlamaToolCallParser(ToolCallParser):
    begin = '{"name"'
    separators = " \t\r\n;"  # Llama 3.1 separates several calls with "; "

    def _started(self) -> None:
        self._scan_from(0)
        self._depth = 0

    def _end(self, text: str) -> int | None:
        """Just past the JSON object's closing brace (braces inside strings do not count)."""
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_json_string(ch):
                continue
            if ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._pos = len(text)
        return None

    def _parse(self, text: str) -> ToolCall | None:
        return _call(text.strip(), "parameters", tagged=False)


def tool_call_parser(kind: str) -> ToolCallParser:
    """A parser of one choice's output in the format `kind` ("qwen" or "llama")."""
    return {"qwen": QwenToolCallParser, "llama": LlamaToolCallParser}[kind]()
