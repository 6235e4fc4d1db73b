"""A chat request's tools: their definitions checked and handed to the chat template, and for
tool_choice "required" or a named function, the grammar that makes the output such a call (an xgrammar
structural tag in the model's tool-call format), so its arguments always validate against the
function's parameter schema. Under "auto", a function marked `strict` gets the same guarantee: the
output is free text until the model opens a call, and the call's arguments follow its schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar

from cluster import GrammarSpec
from router.chat.json_schema import enforced_schema, local_target
from router.chat.structured import check_enforceable, check_json_schema, checked
from router.chat.tool_calls import CALL_SEPARATORS
from router.http.errors import APIError
from router.http.protocol import ChatCompletionRequest, NamedToolChoice

# our tool-call formats as xgrammar's builtin structural tags name them (Qwen2.5 writes Qwen3's calls)
STRUCTURAL_TAG_MODELS = {"qwen": "qwen_3", "llama": "llama"}
NO_ARGUMENTS = {"type": "object", "properties": {}}

ReasoningMode = Literal["enabled", "disabled", "auto"]


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None  # what the chat template renders (None: no tools)
    parse: bool  # whether tool calls are read from the output
    forced: bool  # whether the output must be a call (a grammar makes it one)
    strict: bool = False  # under "auto": whether a grammar makes the calls the model writes follow their schemas


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """Checks the request's tools and tool_choice (400s naming the field) and says what to do with them.
    `parser` is the served model's tool-call format (None: it has none)."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: two functions are named {twice!r}", param="tools")
    named = isinstance(choice, NamedToolChoice)
    forced = choice == "required" or named
    strict = choice == "auto" and any(t.function.strict for t in tools)
    if strict and parser is None:
        field = strict_field(req)
        raise APIError(
            400,
            f"{field}: a strict function's calls follow its parameters by a grammar in the "
            "model's tool-call format, but this server reads none for this model (its tool_call_parser "
            "setting is none)",
            param=field,
        )
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is not None:
            what, field = f"the parameters of function {tool.function.name!r}", f"tools.{i}.function.parameters"
            check_json_schema(params, field, what)
            _check_object(params, field, what)
            if (forced and (not named or choice.function.name == tool.function.name)) or (
                strict and tool.function.strict
            ):
                # a grammar makes the calls' arguments follow them (tool_grammar rewrites them for it)
                check_enforceable(params, field, what)
            checked(GrammarSpec("json_schema", json.dumps(params, ensure_ascii=False)), field)
    if forced and not tools:
        raise APIError(400, "tool_choice asks for a tool call, but the request lists no tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not among the "
            f"tools ({', '.join(names)})",
            param="tool_choice",
        )
    if forced and parser is None:
        raise APIError(
            400,
            "tool_choice asks for a tool call, but this server reads no tool-call format for "
            "this model (its tool_call_parser setting is none)",
            param="tool_choice",
        )
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    parse = parser is not None and choice != "none" and bool(tools)
    return ToolPlan(template_tools, parse=parse, forced=forced, strict=strict)


def strict_field(req: ChatCompletionRequest) -> str:
    """The field of the request's first function marked strict (one is), as a 400 names it."""
    return next(f"tools.{i}.function.strict" for i, t in enumerate(req.tools) if t.function.strict)


# the schema keywords that would let a function's arguments be other than one object, at its top
_NOT_AN_OBJECT = ("anyOf", "oneOf", "allOf", "enum", "const", "items", "prefixItems")


def _check_object(params: Any, field: str, what: str) -> None:
    """A function's arguments are an object (OpenAI requires `"type": "object"`; the tool-call formats
    write them as one): a schema of any other value is a 400, not a call the parser cannot read. A schema
    with no type (`{}`, properties alone) means an object here; a reference at the top (pydantic's
    recursive models) is followed."""
    root, seen = params, set()
    while isinstance(root, dict) and isinstance(root.get("$ref"), str) and root["$ref"] not in seen:
        seen.add(root["$ref"])
        root = local_target(params, root["$ref"])
    kind = root.get("type", "object") if isinstance(root, dict) else None
    if kind != "object" or any(k in root for k in _NOT_AN_OBJECT):
        raise APIError(400, f"{field}: {what} must be a JSON Schema of type object", param=field)


def tool_grammar(req: ChatCompletionRequest, parser: str, reasoning: ReasoningMode) -> GrammarSpec:
    """The structural tag that makes the output one call (a named function), at least one (required), or,
    under "auto" with a `strict` function, text in which each call the model opens is one of the tools,
    written whole; each forced or strict call's arguments follow its function's parameters (a call of
    a function not marked strict, under auto, is any JSON object). `reasoning` says whether a think
    block comes first (Qwen3's)."""
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    auto = req.tool_choice in ("auto", None)

    def parameters(i: int, function: Any) -> Any:
        if auto:
            return _arguments(function, i) if function.strict else {"type": "object"}
        return _arguments(function, i) if named in (None, function.name) else function.parameters

    tools = [
        {"type": "function", "function": {"name": t.function.name, "parameters": parameters(i, t.function)}}
        for i, t in enumerate(req.tools or [])
    ]
    choice = req.tool_choice.model_dump() if named is not None else "auto" if auto else "required"
    try:
        tag = xgrammar.get_model_structural_tag(
            STRUCTURAL_TAG_MODELS[parser],
            tools=tools,
            tool_choice=choice,
            reasoning=reasoning,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            # the arguments' whitespace, free in this format, one character at a time (a model that runs
            # on with newlines and spaces would spend its tokens there)
            max_whitespace_cnt=1,
        )
    except ValueError as e:
        raise APIError(400, f"tools: {e}", param="tools") from e
    tag = json.loads(tag.model_dump_json())
    if choice == "required":
        tag["format"] = _calls_only(tag["format"], CALL_SEPARATORS[parser])
    return checked(GrammarSpec("structural_tag", json.dumps(tag, ensure_ascii=False)), "tools")


def _arguments(function: Any, i: int) -> Any:
    """The schema the calls' arguments of the forced function `i` follow, as the grammar enforces it whole
    (router/chat/json_schema.py): an object (a schema that names no type, `{}` included, is one here, as
    plan_tools checked)."""
    params = function.parameters
    if params is None:
        return NO_ARGUMENTS
    if "type" not in params and "$ref" not in params:
        params = {"type": "object", **params}
    what = f"the parameters of function {function.name!r}"
    return enforced_schema(params, f"tools.{i}.function.parameters", what)


def _calls_only(fmt: dict, separator: str) -> dict:
    """xgrammar's format with its triggered calls (text around them allowed) made calls alone, one
    after another with `separator` between them: once its last call is written the output ends, with
    no text after it."""
    if fmt.get("type") == "triggered_tags":
        return {
            "type": "tags_with_separator",
            "tags": fmt["tags"],
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": fmt.get("stop_after_first", False),
        }
    if fmt.get("type") == "sequence":
        return {**fmt, "elements": [_calls_only(e, separator) for e in fmt["elements"]]}
    return fmt
