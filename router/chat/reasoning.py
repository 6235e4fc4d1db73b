"""Reasoning models' thinking, split from the answer: Qwen3 writes `<think>...</think>` before its
answer, returned as `reasoning_content` apart from `content` (vLLM's and SGLang's qwen3 parsers), as
the text streams or whole: both give the same split."""

from __future__ import annotations

from router.chat.markers import split_held

THINK_START, THINK_END = "<think>", "</think>"


def reasoning_parser_for(setting: str, model_type: str | None) -> str | None:
    """The parser a served model uses: the setting's, or for auto the one its model_type calls for."""
    if setting == "none":
        return None
    if setting == "auto":
        return "qwen3" if (model_type or "").startswith("qwen3") else None
    return setting


def opens_thinking(prompt: str) -> bool:
    """Whether the chat template left the prompt inside a think block (the output then starts in it)."""
    return prompt.rstrip().endswith(THINK_START)


def closes_thinking(prompt: str) -> bool:
    """Whether the prompt ends with a closed think block (a template told not to think writes an empty one)."""
    return prompt.rstrip().endswith(THINK_END)


class ReasoningParser:
    """One choice's text in pieces -> (reasoning, content) pieces. Text is reasoning from a leading
    `<think>` (or from the start, when the prompt opened the block) to `</think>`; the whitespace
    between `</think>` and the answer is dropped. Without a leading `<think>` all of it is content."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._state, self._buffer = "reasoning", head[len(THINK_START) :]
            elif THINK_START.startswith(head):
                return "", ""  # still possibly "<think>"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                reasoning, self._buffer = split_held(self._buffer, THINK_END)
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(THINK_END) :]
            self._state = "answer"
        if self._state == "answer":  # the whitespace after </think> is the template's, not the answer's
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return reasoning, ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the choice has ended."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest if self._state in ("start", "content") else ""
