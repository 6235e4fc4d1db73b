"""Whether xgrammar can turn a constraint into a grammar, asked here at the router (cheaply, without a
tokenizer) so that a bad one is a 400 before it reaches a replica."""

from __future__ import annotations

import functools
from functools import lru_cache

import xgrammar


@lru_cache(maxsize=256)
def grammar_problem(kind: str, spec: str, any_whitespace: bool = False) -> str | None:
    """Why xgrammar cannot build a grammar of this kind from spec (None: it can)."""
    build = {
        "json_schema": functools.partial(xgrammar.Grammar.from_json_schema, any_whitespace=any_whitespace),
        "regex": xgrammar.Grammar.from_regex,
        "ebnf": xgrammar.Grammar.from_ebnf,
        "structural_tag": xgrammar.Grammar.from_structural_tag,
    }[kind]
    try:
        build(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        return f"xgrammar cannot use this {kind.replace('_', ' ')}: {_first_line(e)}"
    return None


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    # xgrammar's messages start with a time and a source location
    return (lines[0].split(": ", 1)[-1] if lines else type(e).__name__)[:300]
