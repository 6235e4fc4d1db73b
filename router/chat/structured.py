"""Structured outputs at the router: a request's `response_format`, vLLM's `structured_outputs`, or one
of its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`, as the GrammarSpec its
replica compiles. Each is
checked here first, cheaply and without a tokenizer (a schema that is no JSON Schema, or that xgrammar
cannot turn into a grammar, is a 400 naming its field), so a bad one never reaches a replica."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema

from cluster import GrammarSpec
from router.chat.grammar_check import grammar_problem
from router.chat.json_schema import enforced_schema
from router.http.errors import APIError
from router.http.protocol import SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' constraints as the guided_* fields they succeed
_GUIDED_OF = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def request_grammar(req: SamplingFields) -> GrammarSpec | None:
    """The grammar the request's output must follow, or None for free text."""
    outputs = req.structured_outputs
    inner = [f"structured_outputs.{name}" for name in outputs.given()] if outputs is not None else []
    given = [name for name in ("response_format", *GUIDED_FIELDS) if _given(req, name)] + inner
    if len(given) > 1:
        raise APIError(
            400, f"send one of {' or '.join(given)}, not both: each constrains the whole output", param=given[1]
        )
    if outputs is not None and not given:  # its options alone (or nothing) constrain nothing
        raise APIError(
            400,
            f"structured_outputs sets no constraint: give one of {', '.join(outputs.CONSTRAINTS)}",
            param="structured_outputs",
        )
    if not given:
        return None
    name = given[0]
    spec = _spec(name, outputs.value(name.split(".")[1]) if name in inner else getattr(req, name))
    disable = _disable_any_whitespace(req)
    if disable is not None and spec.kind == "json_schema":
        spec = checked(dataclasses.replace(spec, any_whitespace=not disable), name)
    return spec


def _disable_any_whitespace(req: SamplingFields) -> bool | None:
    """Whether JSON's whitespace is to be compact (structured_outputs' choice, else response_format's
    extension field); None: the default, compact."""
    outputs, fmt = req.structured_outputs, req.response_format
    if outputs is not None and outputs.disable_any_whitespace is not None:
        return outputs.disable_any_whitespace
    return fmt.disable_any_whitespace if fmt is not None else None


def _spec(name: str, value: Any) -> GrammarSpec:
    """The grammar of one structured-output field (`name` as the client wrote it) set to value."""
    field = name
    if name.startswith("structured_outputs."):
        inner = name.split(".")[1]
        if inner == "json_object":
            return GrammarSpec("json_schema", '{"type": "object"}')
        name = _GUIDED_OF[inner]
    if name == "response_format":
        if value.type == "json_object":
            # an object, as OpenAI's JSON mode promises (xgrammar's builtin JSON grammar allows any value)
            return GrammarSpec("json_schema", '{"type": "object"}')
        return json_schema_grammar(value.json_schema.schema_, field)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise APIError(400, f"{field} is not JSON this server reads: {e}", param=field) from e
        return json_schema_grammar(value, field)
    if name == "guided_regex":
        return checked(GrammarSpec("regex", value), field)
    if name == "guided_choice":
        return checked(GrammarSpec("ebnf", choice_grammar(value, field)), field)
    return checked(GrammarSpec("ebnf", value), field)


def _given(req: SamplingFields, name: str) -> bool:
    value = getattr(req, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def json_schema_grammar(schema: Any, field: str) -> GrammarSpec:
    check_json_schema(schema, field)
    check_enforceable(schema, field)
    schema = enforced_schema(schema, field)
    return checked(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)), field)


def check_json_schema(schema: Any, field: str, what: str = "the schema") -> None:
    """A 400 naming `field` unless schema is a JSON Schema (an object or a boolean) by its metaschema."""
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{field}: {what} must be a JSON Schema object, not {type(schema).__name__}", param=field)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except RecursionError:  # the checks after this one walk the schema too
        raise APIError(400, f"{field}: {what} is nested too deeply", param=field) from None
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path))
        raise APIError(
            400,
            f"{field}: {what} is not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}",
            param=field,
        ) from e


def check_enforceable(schema: Any, field: str, what: str = "the schema") -> None:
    """A 400 naming `field` where a schema that an output must follow uses a keyword the grammar would
    not enforce (the output could break it and still end with "stop")."""
    try:
        keyword = _unenforced(schema)
    except RecursionError:
        raise APIError(400, f"{field}: {what} is nested too deeply", param=field) from None
    if keyword is not None:
        raise APIError(
            400, f"{field}: {what} uses {keyword}, which this server cannot enforce while generating", param=field
        )


# keywords xgrammar 0.2.9 compiles without enforcing (an output may break them and still end with "stop"),
# and allOf of several schemas (it does not merge them). oneOf is generated as anyOf: the two differ only
# where branches overlap, which a discriminated union (pydantic's oneOf) never does
_UNENFORCED = ("not", "contains", "dependentRequired", "dependentSchemas", "if", "then", "else", "uniqueItems")


def _unenforced(schema: Any, where: str = "") -> str | None:
    """The path of the first keyword the grammar would not enforce."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            if (bad := _unenforced(s, f"{where}/{i}")) is not None:
                return bad
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in _UNENFORCED and not (key == "uniqueItems" and value is False):
            return f"{where}/{key}".lstrip("/")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"{where}/{key}".lstrip("/")
        if key in ("const", "enum", "default", "examples"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():  # names, not keywords
                if (bad := _unenforced(sub, f"{where}/{key}/{name}")) is not None:
                    return bad
            continue
        if isinstance(value, (dict, list)) and (bad := _unenforced(value, f"{where}/{key}")) is not None:
            return bad
    return None


def choice_grammar(choices: list[str], field: str = "guided_choice") -> str:
    """An EBNF grammar of exactly one of the strings (JSON's string escapes are EBNF's)."""
    if not choices:
        raise APIError(400, f"{field} must list at least one string", param=field)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def checked(spec: GrammarSpec, field: str) -> GrammarSpec:
    """spec, once xgrammar has turned it into a grammar here; a 400 naming field when it cannot."""
    problem = grammar_problem(spec.kind, spec.spec, spec.any_whitespace)
    if problem is not None:
        raise APIError(400, f"{field}: {problem}", param=field)
    return spec
