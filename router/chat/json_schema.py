"""A JSON Schema rewritten into the form xgrammar 0.2.9 enforces whole, or a 400 naming the part it
would not enforce. Its grammar compiles several valid schemas into rules that let outputs break them
(and still end with "stop"); each such case is rewritten to an equivalent schema it follows, or refused:

- `required` names a property `properties` does not list: the grammar never writes it. Listed here,
  with the schema additionalProperties (or a matching patternProperties) gives its value.
- keywords beside `anyOf` / `oneOf`: the grammar follows the branches alone. Each branch takes them in.
- keywords beside a `$ref`: the grammar follows the reference alone. The referenced schema is taken in
  with them; a reference outside the schema (not `#...`) is refused: nothing here fetches it.
- `enum` / `const` beside other keywords: the grammar writes any listed value. The values the rest of
  the schema rejects are dropped (none left: a 400).
- minLength / maxLength beside `pattern` or `format`, `multipleOf` on non-integers, a `pattern` the
  regex engine cannot read (lookaround): not enforced, refused.
- minProperties with additionalProperties unset: refused by xgrammar as if extra properties were
  forbidden; written out as allowed, as JSON Schema has it."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema

from router.chat.grammar_check import grammar_problem
from router.http.errors import APIError

# keywords that say nothing of which values are valid (kept where they are, never merged into a branch);
# OpenAPI's discriminator, which pydantic writes beside a tagged union's oneOf, only names the tag
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "deprecated"}
    | {"readOnly", "writeOnly", "$defs", "definitions", "discriminator"}
)
_SCHEMA_KEYS = ("additionalProperties", "items", "additionalItems", "propertyNames", "contains", "not")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_BRANCHES = ("anyOf", "oneOf")


def enforced_schema(schema: Any, field: str, what: str = "the schema") -> Any:
    """schema (already a valid JSON Schema) as the grammar will enforce it whole; a 400 naming `field`
    where no such rewrite exists."""
    try:
        return _Rewrite(schema, field, what).node(schema, "", ())
    except RecursionError:
        raise APIError(400, f"{field}: {what} is nested too deeply", param=field) from None


class _Rewrite:
    def __init__(self, root: Any, field: str, what: str) -> None:
        self.root, self.field, self.what = root, field, what

    def refuse(self, where: str, why: str) -> APIError:
        at = f" at {where.lstrip('/')}" if where.strip("/") else ""
        return APIError(400, f"{self.field}: {self.what}{at} {why}", param=self.field)

    def node(self, schema: Any, where: str, inlining: tuple[str, ...]) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        for key in _SCHEMA_KEYS:
            if isinstance(out.get(key), dict):
                out[key] = self.node(out[key], f"{where}/{key}", inlining)
        for key in _SCHEMA_LISTS:
            if key in _BRANCHES and _constraints(out, key):
                continue  # each branch is rewritten once the keywords beside it are in it (distribute)
            if isinstance(out.get(key), list):
                out[key] = [self.node(s, f"{where}/{key}/{i}", inlining) for i, s in enumerate(out[key])]
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: self.node(s, f"{where}/{key}/{name}", inlining) for name, s in out[key].items()}
        if "$ref" in out:
            out = self.reference(out, where, inlining)
        for key in _BRANCHES:
            if key in out and _constraints(out, key):
                out = self.distribute(out, key, where, inlining)
        out = self.enum(out, where)
        self.check_strings(out, where)
        out = self.required(out, where)
        listed = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        least = out.get("minProperties")
        if "additionalProperties" not in out and isinstance(least, int) and least > len(listed):
            out["additionalProperties"] = True
        return out

    def reference(self, schema: dict, where: str, inlining: tuple[str, ...]) -> dict:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.refuse(where, f"refers to {ref!r}, outside the schema: only references into it (#/...) are read")
        rest = _constraints(schema, "$ref")
        if not rest:
            return schema  # the grammar resolves a bare reference itself, recursive ones included
        if ref in inlining:
            raise self.refuse(where, f"sets keywords beside a $ref to {ref!r} inside that same schema")
        target = self.node(copy.deepcopy(self.resolve(ref, where)), where, (*inlining, ref))
        kept = {k: v for k, v in schema.items() if k != "$ref" and k in _ANNOTATIONS}
        return {**kept, **self.merge(target, rest, where, "$ref")}

    def resolve(self, ref: str, where: str) -> Any:
        target = local_target(self.root, ref)
        if target is None:
            raise self.refuse(where, f"refers to {ref!r}, which the schema does not hold")
        return target

    def distribute(self, schema: dict, key: str, where: str, inlining: tuple[str, ...]) -> dict:
        """{rest, anyOf: [a, b]} as {anyOf: [rest and a, rest and b]}: each branch takes in the keywords
        beside it."""
        rest = _constraints(schema, key)
        branches = []
        for i, branch in enumerate(schema[key]):
            at = f"{where}/{key}/{i}"
            if branch is False:
                continue  # never valid: the others stand
            if branch is True:
                branch = {}
            if isinstance(branch.get("$ref"), str) and not _constraints(branch, "$ref"):
                ref = branch["$ref"]
                if ref in inlining:
                    raise self.refuse(at, f"sets keywords beside a reference to {ref!r} inside that same schema")
                branch = self.node(copy.deepcopy(self.resolve(ref, at)), at, (*inlining, ref))
            try:
                branches.append(self.node(self.merge(branch, rest, at, key), at, inlining))
            except _NoValue:
                continue  # its type and the one beside it share no value: the branch never matches
        if not branches:
            raise self.refuse(where, f"allows no value: every branch of its {key} is false")
        kept = {k: v for k, v in schema.items() if k in _ANNOTATIONS}
        return {**kept, key: branches}

    def merge(self, inner: dict | bool, rest: dict, where: str, beside: str) -> dict:
        """Both schemas' keywords in one (each value valid by both); a 400 where both set one differently."""
        if inner is True:
            inner = {}
        if inner is False:
            raise self.refuse(where, f"allows no value: its {beside} is false")
        out = dict(inner)
        for key, value in rest.items():
            if key not in out or out[key] == value:
                out[key] = value
            elif key == "type":
                out[key] = _common_types(out[key], value)
            elif key == "required":
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key == "properties" and not (out[key].keys() & value.keys()):
                out[key] = {**out[key], **value}
            else:
                raise self.refuse(
                    where, f"sets {key} both beside its {beside} and inside it: this server cannot enforce both"
                )
        return out

    def enum(self, schema: dict, where: str) -> dict:
        """An enum or const with other keywords: the values those keywords accept, alone."""
        if "enum" not in schema and "const" not in schema:
            return schema
        rest = _constraints(schema, "enum", "const")
        if not rest and not ("enum" in schema and "const" in schema):
            return schema
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        if "const" in schema and "enum" in schema:
            values = [v for v in values if any(_same(v, e) for e in schema["enum"])]
        if rest:
            defs = {k: self.root[k] for k in ("$defs", "definitions") if isinstance(self.root, dict) and k in self.root}
            check = {**rest, **defs}
            validator = jsonschema.validators.validator_for(check, default=jsonschema.Draft202012Validator)(check)
            try:
                values = [v for v in values if validator.is_valid(v)]
            except Exception:  # noqa: BLE001 - a reference the check cannot follow from here (#/properties/...)
                raise self.refuse(
                    where, "lists enum or const values beside a reference this server cannot check them against"
                ) from None
        if not values:
            raise self.refuse(where, "allows no value: none of its enum or const is valid by the rest of it")
        kept = {k: v for k, v in schema.items() if k in _ANNOTATIONS}
        return {**kept, "enum": values}

    def check_strings(self, schema: dict, where: str) -> None:
        bounded = [k for k in ("minLength", "maxLength") if k in schema]
        shaped = [k for k in ("pattern", "format") if k in schema]
        if bounded and shaped:
            raise self.refuse(
                where, f"bounds a string's length beside its {shaped[0]}: this server cannot enforce both"
            )
        if "multipleOf" in schema and schema.get("type") != "integer":
            raise self.refuse(where, "uses multipleOf on numbers that are not integers: this server cannot enforce it")
        patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
        if isinstance(schema.get("patternProperties"), dict):
            patterns += list(schema["patternProperties"])
        for pattern in patterns:
            if (problem := grammar_problem("regex", pattern)) is not None:
                raise self.refuse(where, f"has the pattern {pattern!r}: {problem}")

    def required(self, schema: dict, where: str) -> dict:
        """Every required name among the properties, with the schema its value has to follow."""
        names = schema.get("required")
        properties = schema.get("properties", {})
        if not isinstance(names, list) or not isinstance(properties, dict):
            return schema
        missing = [n for n in names if isinstance(n, str) and n not in properties]
        if not missing:
            return schema
        properties = dict(properties)
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        for name in missing:
            matching = [s for p, s in patterns.items() if _search(p, name)]
            if len(matching) > 1:
                raise self.refuse(where, f"requires {name!r}, which several patternProperties match")
            if matching:
                properties[name] = matching[0]
            elif extra is False:
                raise self.refuse(where, f"requires {name!r}, unlisted while additionalProperties is false")
            else:
                properties[name] = extra if isinstance(extra, dict) else {}
        return {**schema, "properties": properties}


def local_target(schema: Any, ref: str) -> Any:
    """What a reference into schema (`#/...`, a JSON Pointer) points at; None where it points at nothing."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _NoValue(Exception):
    """Two schemas merged share no value."""


def _common_types(a: str | list, b: str | list) -> str | list:
    """The JSON types both allow (an integer is a number); _NoValue when none."""
    left, right = {a} if isinstance(a, str) else set(a), {b} if isinstance(b, str) else set(b)
    both = left & right
    if ("integer" in left and "number" in right) or ("number" in left and "integer" in right):
        both.add("integer")
    if not both:
        raise _NoValue
    return next(iter(both)) if len(both) == 1 else sorted(both)


def _constraints(schema: dict, *besides: str) -> dict:
    """The keywords of schema that constrain values, but for those named."""
    return {k: v for k, v in schema.items() if k not in _ANNOTATIONS and k not in besides}


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and true differ, 1 and 1.0 do not."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False
