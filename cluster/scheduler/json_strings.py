"""JSON Schema strings bounded in length, rewritten as patterns before xgrammar compiles them: xgrammar
0.2.9 turns a string with maxLength or minLength into a rule that admits raw control characters (and
byte sequences that are no UTF-8), which JSON forbids, so an output it completed could fail
json.loads or its length. The pattern bounds the same number of characters, each one JSON writes
unescaped."""

from __future__ import annotations

import json
from typing import Any

# one character of a JSON string's text that JSON writes unescaped: no quote, backslash, control
# character or surrogate. The ranges follow UTF-8's lengths (and the surrogates' gap) because xgrammar
# encodes a wider range loosely (it admits overlong and surrogate byte sequences, no UTF-8); characters
# past the Basic Multilingual Plane are left out
_CHAR = (
    "(?:[ !#-\\[\\]-\\u007f]|[\\u0080-\\u07ff]|[\\u0800-\\u0fff]|[\\u1000-\\ucfff]|[\\ud000-\\ud7ff]|[\\ue000-\\uffff])"
)
_OTHER_BOUNDS = ("pattern", "format", "enum", "const")


def bounded_strings(node: Any) -> Any:
    """`node` (a JSON Schema, or a structural tag holding some) with every string schema that bounds its
    length by maxLength or minLength alone given the pattern of that many plain characters instead."""
    if isinstance(node, list):
        return [bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {key: bounded_strings(value) for key, value in node.items()}
    bounded = "maxLength" in out or "minLength" in out
    if out.get("type") == "string" and bounded and not any(k in out for k in _OTHER_BOUNDS):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_CHAR}{{{low},{high}}}$"
    return out


def bounded_strings_text(text: str) -> str:
    """bounded_strings over JSON text (unchanged when nothing is bounded)."""
    schema = json.loads(text)
    rewritten = bounded_strings(schema)
    return text if rewritten == schema else json.dumps(rewritten, ensure_ascii=False)
