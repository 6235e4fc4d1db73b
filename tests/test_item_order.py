"""The Responses and Messages APIs' output in the order the model wrote it: text after a call is an item (a
block) of its own after that call, whole as streamed; a call's opening tag cut short shows nowhere; and a
call's numbers past a double's range leave a whole message valid JSON, as written."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.chat.output import ChatOutput
from router.http.messages_api.output import blocks_of, json_response, message_body, stop_of, usage
from router.http.messages_api.stream import MessageEvents
from router.http.responses import Formatter
from router.http.responses_api.output import ResponseHead, items_of, status_of
from router.http.responses_api.protocol import ResponsesRequest
from router.http.responses_api.stream import ResponseEvents
from router.replicas.generation import Piece

OUTPUT = ChatOutput(tool_calls="qwen", unfinished_calls_as_text=False, keeps_order=True)


def call(name: str, arguments: str = '{"city": "Paris"}') -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TEXTS = {
    "text, call, text": (f"Hello there.\n{call('w')}\nGoodbye now.", "stop"),
    "call, text": (f"{call('w')}\nAfter.", "stop"),
    "text, call, text, call, text cut short": (f"A.\n{call('w')}\nB.\n{call('t')}\nC and", "length"),
    "text, call": (f"Checking.\n{call('w')}", "stop"),
    "two calls": (f"{call('w')}\n{call('t')}", "stop"),
    "text alone cut short": ("Just text", "length"),
    "nothing": ("", "stop"),
}


def pieces_of(text: str, finish: str, size: int = 3) -> list[Piece]:
    """The text as a stream brings it: a few characters a piece (as tokens), the last with its finish reason."""
    pieces = [Piece(text[i : i + size], [1]) for i in range(0, len(text), size)] or [Piece("", [1])]
    pieces[-1].finish_reason = finish
    return pieces


def whole_message(pieces: list[Piece], output: ChatOutput = OUTPUT) -> tuple[dict, str]:
    choice = Formatter("id", "m", True, None, None, output=output).whole(pieces, 1)["choices"][0]
    return choice["message"], choice["finish_reason"]


async def _chunks(pieces: list[Piece], output: ChatOutput = OUTPUT):
    fmt = Formatter("id", "m", True, None, None, output=output)
    for p in pieces:
        if event := fmt.chunk_sse(p):
            for part in event.split("\n\n"):
                if part.startswith("data: "):
                    yield json.loads(part.removeprefix("data: "))
    yield fmt.usage_chunk(1, len(pieces))


def streamed(events) -> list[dict]:
    async def run() -> list[dict]:
        return [
            json.loads(line.removeprefix("data: "))
            async for event in events
            for line in event.splitlines()
            if line.startswith("data: ")
        ]

    return asyncio.run(run())


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


ONE_CALL = ChatOutput(tool_calls="qwen", unfinished_calls_as_text=False, keeps_order=True, max_calls=1)
# (output, text, finish): parallel_tool_calls false drops the second call, and the text around it joins up
CASES = {name: (OUTPUT, *TEXTS[name]) for name in TEXTS} | {
    "a call dropped": (ONE_CALL, f"a{call('w')}b{call('t')}c", "stop"),
    "a tag's start ending a stop": (OUTPUT, "Compare: a <", "stop"),  # kept: not cut short by the limit
}


@pytest.mark.parametrize("name", CASES)
def test_a_responses_output_whole_is_its_stream_item_for_item(name):
    output, text, finish = CASES[name]
    message, reason = whole_message(pieces_of(text, finish), output)
    status, _ = status_of(reason)
    whole = items_of(message, status)
    head = ResponseHead(ResponsesRequest(model="m", input="x"), "m")
    events = streamed(ResponseEvents(head, lambda text: 0).events(_chunks(pieces_of(text, finish), output)))
    final = events[-1]["response"]
    assert final["status"] == status
    assert without_ids(whole) == without_ids(final["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("name", CASES)
def test_a_messages_content_whole_is_its_stream_block_for_block(name):
    output, text, finish = CASES[name]
    message, reason = whole_message(pieces_of(text, finish), output)
    whole = blocks_of(message)
    stop = lambda reason, ids: stop_of(reason, ids, set(), [], None)  # noqa: E731
    events = streamed(MessageEvents("msg", "m", 1, stop).events(_chunks(pieces_of(text, finish), output)))
    blocks: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                blocks[-1]["input"] = json.loads(delta["partial_json"])
    assert without_ids(whole) == without_ids(blocks)


def test_text_after_a_call_is_an_item_of_its_own_after_it():
    message, _ = whole_message(pieces_of(*TEXTS["text, call, text"]))
    items = items_of(message, "completed")
    assert [(i["type"], i.get("name") or i["content"][0]["text"]) for i in items] == [
        ("message", "Hello there.\n"),
        ("function_call", "w"),
        ("message", "Goodbye now."),
    ]
    assert [b["type"] for b in blocks_of(message)] == ["text", "tool_use", "text"]
    # the chat API's own message keeps its shape: the text whole, the calls beside it
    chat = Formatter("id", "m", True, None, None, output=ChatOutput(tool_calls="qwen"))
    plain = chat.whole(pieces_of(*TEXTS["text, call, text"]), 1)["choices"][0]["message"]
    assert plain["content"] == "Hello there.\nGoodbye now." and "in_order" not in plain


@pytest.mark.parametrize("cut", range(1, len("<tool_call>")))
def test_an_opening_tag_cut_short_shows_nowhere(cut):
    """A call cut by max_output_tokens before its opening tag was whole is no text either (README)."""
    message, _ = whole_message(pieces_of("Sure. " + "<tool_call>"[:cut], "length"))
    assert [i["content"][0]["text"] for i in items_of(message, "incomplete")] == ["Sure. "]
    chat = Formatter("id", "m", True, None, None, output=ChatOutput(tool_calls="qwen"))
    kept = chat.whole(pieces_of("Sure. " + "<tool_call>"[:cut], "length"), 1)["choices"][0]["message"]
    assert kept["content"] == "Sure. " + "<tool_call>"[:cut]  # chat shows it, as vLLM does


def test_a_number_past_a_doubles_range_leaves_the_whole_message_json_as_written():
    message, reason = whole_message(pieces_of(call("w", '{"x": 1E+999, "y": 1e99999999999999999999}'), "stop"))
    body = message_body("msg", "m", blocks_of(message), stop_of(reason, [1], set(), [], None), usage(1, 1))
    text = json_response(body).body.decode()
    assert '"input": {"x": 1E+999, "y": 1e99999999999999999999}' in text
    assert json.loads(text)["content"][0]["name"] == "w"  # JSON (Python reads the numbers as inf)


def test_the_text_around_a_dropped_call_and_a_tags_start_at_a_stop_are_kept_as_written():
    message, _ = whole_message(pieces_of(*CASES["a call dropped"][1:]), ONE_CALL)
    assert [b.get("text") or b["name"] for b in blocks_of(message)] == ["a", "w", "bc"]
    message, _ = whole_message(pieces_of("Compare: a <", "stop"))
    assert blocks_of(message) == [{"type": "text", "text": "Compare: a <"}]


def test_a_chunk_of_text_after_a_call_carries_the_usage_so_far_where_every_chunk_does():
    from router.http.extras import Extras

    fmt = Formatter(
        "id", "m", True, None, None, output=ChatOutput(tool_calls="qwen"), extras=Extras(continuous_usage=True)
    )
    event = fmt.chunk_sse(Piece(f"{call('w')}\nAfter.", [1, 2, 3], finish_reason="stop"))
    chunks = [json.loads(part.removeprefix("data: ")) for part in event.split("\n\n") if part]
    assert [list(c["choices"][0]["delta"]) for c in chunks] == [["tool_calls"], ["content"]]
    assert all(c["usage"]["completion_tokens"] == 3 for c in chunks)
