"""Schemas that xgrammar 0.2.9 compiles into grammars an output could break (router/chat/json_schema.py):
each is rewritten so that the grammar accepts exactly what the schema does on the outputs below, checked
against the schema itself with jsonschema, or refused with a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from router.chat.structured import json_schema_grammar
from router.http.errors import APIError

OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}},
    "required": ["v"],
}
# (schema, outputs it allows, outputs it does not): the grammar must agree with the schema on each
CASES = {
    "a required name the properties leave out": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]},
        ['{"z": 1}', '{"a": 1, "z": "x"}'],
        ['{"a": 1}', "{}"],
    ),
    "a required name typed by additionalProperties": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "required": ["q"]},
        ['{"q": 1}'],
        ["{}", '{"q": "s"}'],
    ),
    "anyOf branches that only require, beside the properties": (
        {"type": "object", "properties": OBJ_AB, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
        | {"additionalProperties": False},
        ['{"a": 1}', '{"b": 2}', '{"a": 1, "b": 2}'],
        ["{}", '"x"', "3"],
    ),
    "oneOf beside a type": (
        {"type": "object", "properties": {"x": {"type": "string"}}, "oneOf": [{"required": ["x"]}]},
        ['{"x": "a"}'],
        ["{}", "3"],
    ),
    "a branch whose type the one beside it excludes": (
        {"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]},
        ['"a"'],
        ["1"],
    ),
    "a bound beside a $ref": (
        {"$defs": {"A": {"type": "string"}}, "$ref": "#/$defs/A", "maxLength": 3},
        ['"ab"'],
        ['"abcdef"', "1"],
    ),
    "an enum with a length bound": (
        {"type": "string", "enum": ["abcdef", "ab"], "maxLength": 3},
        ['"ab"'],
        ['"abcdef"'],
    ),
    "an enum beside a type it partly breaks": ({"type": "integer", "enum": [1.5, 2]}, ["2"], ["1.5"]),
    "an enum of mixed types beside one": ({"type": "string", "enum": ["a", 1, None]}, ['"a"'], ["1", "null"]),
    "minProperties with extra properties allowed by default": (
        {"type": "object", "minProperties": 1},
        ['{"a": 1}'],
        ["{}"],
    ),
    "a recursive reference, unchanged": (
        {"$defs": {"N": NODE}, "$ref": "#/$defs/N"},
        ['{"v": 1, "next": {"v": 2, "next": null}}', '{"v": 1}'],
        ['{"next": null}'],
    ),
    "integers that are multiples": ({"type": "integer", "multipleOf": 7}, ["14"], ["8"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_grammar_agrees_with_the_schema(name):
    schema, valid, invalid = CASES[name]
    spec = json_schema_grammar(schema, "response_format")
    grammar = xgrammar.Grammar.from_json_schema(spec.spec, any_whitespace=True)
    for text in valid:
        jsonschema.validate(json.loads(text), schema)  # the case itself is right
        assert _is_grammar_accept_string(grammar, text), (text, spec.spec)
    for text in invalid:
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
        assert not _is_grammar_accept_string(grammar, text), (text, spec.spec)


REFUSED = {
    "a reference outside the schema": ({"$ref": "https://example.com/s.json"}, "outside the schema"),
    "a length beside a pattern": (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 4},
        "length beside its pattern",
    ),
    "a length beside a format": ({"type": "string", "format": "date", "maxLength": 4}, "length beside its format"),
    "a lookahead": ({"type": "string", "pattern": "^(?=a)[a-z]{2}$"}, "Lookahead"),
    "multipleOf on numbers": ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    "a const of another type": ({"type": "string", "const": 5}, "allows no value"),
    "a required name additionalProperties forbids": (
        {"type": "object", "properties": {"a": {}}, "required": ["z"], "additionalProperties": False},
        "'z'",
    ),
    "an enum beside a reference the check cannot follow": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": [1], "allOf": [{"$ref": "#/properties/a"}]}},
        },
        "cannot check them",
    ),
    "keywords set twice beside an anyOf": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"a": {}}}]},
        "properties both beside its anyOf",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_schema_the_grammar_cannot_follow_is_a_400_naming_the_field(name):
    schema, says = REFUSED[name]
    with pytest.raises(APIError) as e:
        json_schema_grammar(schema, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format" and says in e.value.message


def test_a_pydantic_models_schema_keeps_its_shape():
    """What the openai client's parse sends: references, optional fields (anyOf with null) and a tagged
    union (oneOf beside OpenAPI's discriminator) are enforced as they are, left unrewritten but for a
    const written as a one-value enum."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        name: str | None = Field(default=None, max_length=10)

    class Pet(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")
        tags: list[str] = Field(min_length=1, max_length=3)

    schema = Pet.model_json_schema()
    rewritten = json.loads(json_schema_grammar(schema, "response_format").spec)
    assert rewritten["properties"]["pet"] == schema["properties"]["pet"]  # the oneOf of two $refs, untouched
    assert rewritten["$defs"]["Cat"]["properties"]["kind"] == {"title": "Kind", "enum": ["cat"]}
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(rewritten), any_whitespace=True)
    assert _is_grammar_accept_string(grammar, '{"pet": {"kind": "dog", "name": null}, "tags": ["a"]}')
    assert not _is_grammar_accept_string(grammar, '{"pet": {"kind": "cat", "lives": 10}, "tags": ["a"]}')
