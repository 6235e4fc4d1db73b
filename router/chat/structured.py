"""Structured outputs at the router: a request's `response_format`, or one of vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`, as the GrammarSpec its replica compiles. Each is
checked here first, cheaply and without a tokenizer (a schema that is no JSON Schema, or that xgrammar
cannot turn into a grammar, is a 400 naming its field), so a bad one never reaches a replica."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jsonschema
import xgrammar

from cluster import GrammarSpec
from router.http.errors import APIError
from router.http.protocol import SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_grammar(req: SamplingFields) -> GrammarSpec | None:
    """The grammar the request's output must follow, or None for free text."""
    given = [name for name in ("response_format", *GUIDED_FIELDS) if _given(req, name)]
    if len(given) > 1:
        raise APIError(
            400, f"send one of {' or '.join(given)}, not both: each constrains the whole output", param=given[1]
        )
    if not given:
        return None
    name = given[0]
    value = getattr(req, name)
    if name == "response_format":
        if value.type == "json_object":
            # an object, as OpenAI's JSON mode promises (xgrammar's builtin JSON grammar allows any value)
            return GrammarSpec("json_schema", '{"type": "object"}')
        return json_schema_grammar(value.json_schema.schema_, "response_format")
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(400, f"guided_json is not JSON: {e}", param=name) from e
        return json_schema_grammar(value, name)
    if name == "guided_regex":
        return checked(GrammarSpec("regex", value), name)
    if name == "guided_choice":
        return checked(GrammarSpec("ebnf", choice_grammar(value)), name)
    return checked(GrammarSpec("ebnf", value), name)


def _given(req: SamplingFields, name: str) -> bool:
    value = getattr(req, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def json_schema_grammar(schema: Any, field: str) -> GrammarSpec:
    check_json_schema(schema, field)
    return checked(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)), field)


def check_json_schema(schema: Any, field: str, what: str = "the schema") -> None:
    """A 400 naming `field` unless schema is a JSON Schema (an object or a boolean) by its metaschema."""
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{field}: {what} must be a JSON Schema object, not {type(schema).__name__}", param=field)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path))
        raise APIError(
            400,
            f"{field}: {what} is not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}",
            param=field,
        ) from e


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of the strings (JSON's string escapes are EBNF's)."""
    if not choices:
        raise APIError(400, "guided_choice must list at least one string", param="guided_choice")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def checked(spec: GrammarSpec, field: str) -> GrammarSpec:
    """spec, once xgrammar has turned it into a grammar here; a 400 naming field when it cannot."""
    problem = _problem(spec.kind, spec.spec)
    if problem is not None:
        raise APIError(400, f"{field}: {problem}", param=field)
    return spec


@lru_cache(maxsize=256)
def _problem(kind: str, spec: str) -> str | None:
    build = {
        "json_schema": xgrammar.Grammar.from_json_schema,
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
