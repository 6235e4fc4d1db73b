"""Finding markers (`<think>`, `<tool_call>`) in text that arrives in pieces: what to hold back."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at text's end could begin marker: they wait for the next piece, which says
    whether the marker is there."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_held(text: str, marker: str) -> tuple[str, str]:
    """text as (what can go out now, what is held back until the next piece)."""
    keep = held_back(text, marker)
    return text[: len(text) - keep], text[len(text) - keep :]
