"""The chat output parsers on text: tool calls in the Qwen and Llama formats, Qwen3's reasoning split,
and both together; a text split into pieces anyhow (as a stream splits it) reads as the whole does."""

from __future__ import annotations

import json
import random

import pytest

from router.chat.output import ChatOutput, ChatParts
from router.chat.reasoning import ReasoningParser, reasoning_parser_for
from router.chat.tool_calls import tool_call_parser, tool_call_parser_for
from router.http.responses import Formatter
from router.replicas.generation import Piece


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Ways a stream may cut text: whole, one character at a time, at every single point, and at random."""
    rng = random.Random(seed)
    ways = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return ways


def read(output: ChatOutput, pieces: list[str]) -> ChatParts:
    parser, parts = output.parser(), ChatParts()
    for piece in pieces:
        parts += parser.feed(piece)
    parts += parser.finish()
    return parts


def calls(parts: ChatParts) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parts.tool_calls]


QWEN_TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": '
    '"a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def test_qwen_calls_are_read_with_the_text_before_them_as_content():
    parts = read(ChatOutput(tool_calls="qwen"), [QWEN_TWO_CALLS])
    assert parts.content == "Let me check.\n"
    assert calls(parts) == [("get_weather", {"city": "Paris", "note": 'a } and a " inside'}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in parts.tool_calls)
    assert len({c.id for c in parts.tool_calls}) == 2


@pytest.mark.parametrize("pieces", [[QWEN_TWO_CALLS], list(QWEN_TWO_CALLS)])
def test_with_parallel_calls_off_only_the_first_call_is_kept(pieces):
    parts = read(ChatOutput(tool_calls="qwen", max_calls=1), pieces)
    assert parts.content == "Let me check.\n"
    assert calls(parts) == [("get_weather", {"city": "Paris", "note": 'a } and a " inside'})]


def test_llama_calls_are_read_from_its_json_form():
    text = (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    parts = read(ChatOutput(tool_calls="llama"), [text])
    assert parts.content == ""
    assert calls(parts) == [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]


def test_arguments_come_back_as_json_text_of_an_object():
    text = '<tool_call>\n{"name": "f", "arguments": {"x":1,"y" : "é"}}\n</tool_call>'
    parts = read(ChatOutput(tool_calls="qwen"), [text])
    assert json.loads(parts.tool_calls[0].arguments) == {"x": 1, "y": "é"}
    assert parts.tool_calls[0].as_openai(3) == {
        "index": 3,
        "id": parts.tool_calls[0].id,
        "type": "function",
        "function": {"name": "f", "arguments": parts.tool_calls[0].arguments},
    }


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "a < b and <tool_ca",  # a marker's start that never completes
        '<tool_call>\n{"name": "f", "arguments": {"x": ',  # cut before the call closes
    ],
)
def test_text_that_is_no_call_stays_content(text):
    parts = read(ChatOutput(tool_calls="qwen"), [text])
    assert (parts.content, parts.tool_calls) == (text, [])


@pytest.mark.parametrize(
    "arguments",
    ['{"x": NaN}', '{"x": -Infinity}', '"{\\"x\\": NaN}"', "[" * 100_000 + "]" * 100_000],
    ids=["nan", "infinity", "nan-in-a-string", "nested-past-the-recursion-limit"],
)
@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_arguments_python_reads_and_json_has_not_are_no_call(kind, arguments):
    if kind == "qwen":
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    else:
        text = f'{{"name": "f", "parameters": {arguments}}}'
    parts = read(ChatOutput(tool_calls=kind), [text])
    assert (parts.content, parts.tool_calls) == (text, [])


def _strict(text: str) -> object:
    """JSON as a strict parser reads it: no NaN or Infinity."""

    def refuse(constant: str):
        raise ValueError(constant)

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_numbers_are_kept_as_written_even_past_a_double(kind):
    """A schema's grammar lets a number's exponent run past a double's (a forced call of a `number`
    parameter wrote 7E9906): the call is still a call, and its arguments stay JSON, the number as written
    rather than Infinity; an exponent past even a Decimal's (1e99999999999999999999) too."""
    arguments = (
        '{"big": 7E9906, "small": 1e-400, "plain": 0.1, "exp": 2.5e3, "int": 12, "list": [1.50, -0.0], '
        '"huge": 1e99999999999999999999}'
    )
    if kind == "qwen":
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    else:
        text = f'{{"name": "f", "parameters": {arguments}}}'
    for pieces in splits(text)[:40]:
        parts = read(ChatOutput(tool_calls=kind), pieces)
        assert parts.content == "" and [c.name for c in parts.tool_calls] == ["f"]
        args = parts.tool_calls[0].arguments
        assert "Infinity" not in args and _strict(args)["int"] == 12
        assert args == arguments


def test_a_closing_tag_inside_an_argument_does_not_end_the_call():
    text = (
        'See:\n<tool_call>\n{"name": "write", "arguments": {"code": "x = \'</tool_call>\' # \\" done"}}\n'
        "</tool_call>\nAfter."
    )
    for pieces in splits(text):
        parts = read(ChatOutput(tool_calls="qwen"), pieces)
        assert calls(parts) == [("write", {"code": "x = '</tool_call>' # \" done"})], pieces
        assert parts.content == "See:\nAfter."


@pytest.mark.parametrize("tail", ["\n", "\n<", "\n</to", "\n</tool_call"])
def test_a_call_whose_closing_tag_never_comes_is_still_read_when_its_json_is_whole(tail):
    """The output ended (max_tokens) before the closing tag, or part-way through it."""
    parts = read(ChatOutput(tool_calls="qwen"), ['<tool_call>\n{"name": "f", "arguments": {"x": 1}}' + tail])
    assert calls(parts) == [("f", {"x": 1})] and parts.content == ""


def test_llama_text_that_is_no_call_stays_content():
    for text in ('{"name": "f", "parameters": 3}', 'The answer is {"name": "x"} and more', '{"name": "f", "par'):
        parts = read(ChatOutput(tool_calls="llama"), [text])
        assert (parts.content, parts.tool_calls) == (text, []), text


def test_reasoning_is_split_from_the_answer():
    parts = read(ChatOutput(reasoning=True), ["<think>\nLet me see.\n</think>\n\nThe answer."])
    assert (parts.reasoning, parts.content) == ("\nLet me see.\n", "The answer.")


def test_without_a_think_block_everything_is_content():
    text = "  Just an answer, with <think> later on."
    assert (read(ChatOutput(reasoning=True), [text]).reasoning, read(ChatOutput(reasoning=True), [text]).content) == (
        "",
        text,
    )


def test_a_prompt_that_opened_the_think_block_starts_the_output_in_it():
    parts = read(ChatOutput(reasoning=True, starts_in_reasoning=True), ["thinking...</think>answer"])
    assert (parts.reasoning, parts.content) == ("thinking...", "answer")


def test_an_unclosed_think_block_is_all_reasoning():
    parts = read(ChatOutput(reasoning=True), ["<think>still thinking when max_tokens came"])
    assert (parts.reasoning, parts.content) == ("still thinking when max_tokens came", "")


def test_reasoning_then_a_tool_call():
    text = '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>'
    parts = read(ChatOutput(reasoning=True, tool_calls="qwen"), [text])
    assert parts.reasoning == "I need the weather." and parts.content == ""
    assert calls(parts) == [("w", {"c": "Oslo"})]


CASES = [
    (ChatOutput(tool_calls="qwen"), QWEN_TWO_CALLS),
    (ChatOutput(tool_calls="qwen"), "no call here, only <tool and <tool_call> that is broken </tool_call> x"),
    (
        ChatOutput(tool_calls="llama"),
        '{"name": "a", "parameters": {"s": "}{\\\\\\"", "n": {"m": [1]}}};\n{"name": "b", "parameters": {}}',
    ),
    (ChatOutput(tool_calls="llama"), 'Plain text with a { brace and {"name" in it'),
    (ChatOutput(reasoning=True), "<think>abc</think>hello"),
    (ChatOutput(reasoning=True), "\n<think>a</thin</think>  \n b </think>"),
    (ChatOutput(reasoning=True), "<thinking is not a tag"),
    (ChatOutput(reasoning=True, starts_in_reasoning=True), "x</think>\n\n"),
    (
        ChatOutput(reasoning=True, tool_calls="qwen"),
        '<think>\nhm\n</think>\n\nSure <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>',
    ),
]


@pytest.mark.parametrize("output,text", CASES, ids=[f"case-{i}" for i in range(len(CASES))])
def test_any_split_of_the_text_reads_as_the_whole_does(output, text):
    whole = read(output, [text])
    for pieces in splits(text):
        parts = read(output, pieces)
        assert (parts.reasoning, parts.content, calls(parts)) == (whole.reasoning, whole.content, calls(whole)), pieces


def test_the_parsers_are_picked_by_model_type():
    assert [tool_call_parser_for("auto", t) for t in ("qwen3", "qwen2", "qwen3_moe", "llama", "mistral", None)] == [
        "qwen",
        "qwen",
        "qwen",
        "llama",
        None,
        None,
    ]
    assert tool_call_parser_for("none", "qwen3") is None and tool_call_parser_for("llama", "qwen3") == "llama"
    assert [reasoning_parser_for("auto", t) for t in ("qwen3", "qwen3_moe", "qwen2", "llama")] == [
        "qwen3",
        "qwen3",
        None,
        None,
    ]
    assert reasoning_parser_for("none", "qwen3") is None and reasoning_parser_for("qwen3", "llama") == "qwen3"


def test_parsers_hold_back_only_what_may_start_a_marker():
    tools, reasoning = tool_call_parser("qwen"), ReasoningParser()
    assert tools.feed("abc <tool") == ("abc ", [])
    assert tools.feed("box") == ("<toolbox", [])
    assert reasoning.feed("<thi") == ("", "")
    assert reasoning.feed("s") == ("", "<this")


def test_a_streamed_chat_of_reasoning_text_and_calls_adds_up_to_the_whole_message():
    text = (
        '<think>plan</think>\n\nOn it. <tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>'
    )
    output = ChatOutput(reasoning=True, tool_calls="qwen")
    cuts = [0, 3, 9, 20, 31, 44, 60, 77, 100, len(text)]
    pieces = [Piece(text[a:b]) for a, b in zip(cuts, cuts[1:])]
    pieces[-1].finish_reason = "stop"
    whole = Formatter("id", "m", True, None, None, output=output).whole(pieces, 1)["choices"][0]
    stream = Formatter("id", "m", True, None, None, output=output)
    chunks = [json.loads(event.removeprefix("data: ")) for p in pieces if (event := stream.chunk_sse(p))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert whole["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "On it. ")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas) == "On it. "
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == [0, 1]
    assert [c["function"] for c in streamed] == [c["function"] for c in message["tool_calls"]]


def test_a_forced_calls_arguments_take_whitespace_one_character_at_a_time():
    """A model that runs on with newlines inside a forced call's JSON would spend its tokens there: the
    grammar allows no run of whitespace (xgrammar's structural tags have no compact JSON)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from router.chat.tools import tool_grammar
    from router.http.protocol import ChatCompletionRequest

    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
            "tool_choice": "required",
        }
    )
    grammar = xgrammar.Grammar.from_structural_tag(tool_grammar(req, "llama", "disabled").spec)
    assert _is_grammar_accept_string(grammar, '{"name": "f", "parameters": {"city": "Oslo"}}')
    assert not _is_grammar_accept_string(grammar, '{"name": "f", "parameters": {\n    "city" : "Oslo"\n\n}}')


def _strict_grammar(tools: list[dict], parser: str, **fields):
    """The grammar a chat request under tool_choice auto gets for its tools, compiled by xgrammar."""
    import xgrammar

    from router.chat.tools import plan_tools, tool_grammar
    from router.http.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools, **fields}
    )
    assert plan_tools(req, parser).strict
    return xgrammar.Grammar.from_structural_tag(tool_grammar(req, parser, "disabled").spec)


CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}


def test_a_strict_function_under_auto_leaves_text_free_and_makes_its_calls_follow_the_schema():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}},
        {"type": "function", "function": {"name": "note", "parameters": CITY}},  # not strict: any object
    ]
    grammar = _strict_grammar(tools, "qwen")
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert accepts(grammar, "Just text, no call.")
    assert accepts(grammar, "Let me look. " + call.format("weather", '{"city": "Oslo"}') + " Done.")
    assert accepts(grammar, call.format("weather", '{"city": "Lima"}') + "\n" + call.format("note", '{"x": [1]}'))
    assert not accepts(grammar, call.format("weather", '{"city": "Paris"}'))  # not in the enum
    assert not accepts(grammar, call.format("weather", "{}"))  # city is required
    assert not accepts(grammar, call.format("note", "[1]"))  # any object, but an object
    assert not accepts(grammar, call.format("nobody", "{}"))  # an opened call names a listed function


def test_a_strict_function_without_parallel_calls_ends_the_output_after_its_call():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}}]
    grammar = _strict_grammar(tools, "llama", parallel_tool_calls=False)
    one = '{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert accepts(grammar, "Sure. " + one)
    assert not accepts(grammar, "Sure. " + '{"name": "weather", "parameters": {"city": "Rome"}}')
    assert not accepts(grammar, one + "; " + one)


@pytest.mark.parametrize("choice", ["none", "required", None])
def test_strict_makes_no_grammar_of_its_own_but_under_auto(choice):
    from router.chat.tools import plan_tools
    from router.http.errors import APIError
    from router.http.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}}]
    fields = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    req = ChatCompletionRequest.model_validate(fields | ({} if choice is None else {"tool_choice": choice}))
    # no choice with tools is auto; required forces its calls with a grammar anyway
    assert plan_tools(req, "qwen").strict is (choice is None)
    unmarked = fields | {"tools": [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]}
    assert not plan_tools(ChatCompletionRequest.model_validate(unmarked), "qwen").strict
    if choice is None:  # with no tool-call format there is no call to constrain
        with pytest.raises(APIError) as refused:
            plan_tools(req, None)
        assert refused.value.status == 400 and refused.value.param == "tools.0.function.strict"


@pytest.mark.parametrize("fmt,cut", [("qwen", '<tool_call>\n{"name": "f", "argu'), ("llama", '{"name": "f", "parame')])
def test_a_call_cut_short_is_content_for_chat_and_dropped_for_the_apis_of_items(fmt, cut):
    text = "Let me check. " + cut
    for pieces in splits(text)[:40]:
        chat = read(ChatOutput(tool_calls=fmt), pieces)
        assert chat.content == text and not chat.tool_calls  # as vLLM's: what the model wrote
        items = read(ChatOutput(tool_calls=fmt, unfinished_calls_as_text=False), pieces)
        assert items.content == "Let me check. " and not items.tool_calls


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_calls_written_in_a_format_read_back_as_the_same_calls(kind):
    """Earlier calls a template does not render are written as the model writes them: its parser reads the
    text back as those calls, their arguments' numbers as written."""
    from router.chat.tool_calls import written_calls

    calls = [
        {"function": {"name": "w", "arguments": {"c": "Oslo", "n": [1, 2.5]}}},
        {"function": {"name": "t", "arguments": '{"at": 1e3, "z": "\\u00e9"}'}},
    ]
    parser = tool_call_parser(kind)
    content, got = parser.feed(written_calls(kind, calls))
    rest, last = parser.finish()
    got += last
    assert (content + rest).strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in got] == [
        ("w", {"c": "Oslo", "n": [1, 2.5]}),
        ("t", {"at": 1e3, "z": "é"}),
    ]
