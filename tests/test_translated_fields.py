"""An error the chat path finds in a Responses or Messages request names the field the client sent: the item or
block a chat message came from, not the message's index in the chat request the API's was translated into
(which counts the instructions or the system prompt, a previous response's turns, and calls merged into the
turn before them)."""

from __future__ import annotations

import pytest

from router.http.chat_bridge import Origins, renamed
from router.http.errors import APIError
from router.http.messages_api.protocol import MessagesRequest
from router.http.messages_api.service import FIELD_NAMES as MESSAGES_NAMES
from router.http.messages_api.translate import chat_of as messages_chat_of
from router.http.responses_api.protocol import ResponsesRequest
from router.http.responses_api.service import FIELD_NAMES as RESPONSES_NAMES
from router.http.responses_api.translate import chat_of as responses_chat_of
from router.http.responses_api.translate import input_messages

CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
INPUT = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking."},
    CALL,  # input.2: merged into the assistant turn before it
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]


def error_at(chat_field: str) -> APIError:
    return APIError(400, f"{chat_field}: wrong", param=chat_field)


@pytest.mark.parametrize("instructions", [None, "Be brief."])
@pytest.mark.parametrize(
    "chat_field, named",
    [
        ("messages.{at}.tool_calls", "input.2"),
        ("messages.{at}", "input.1"),
        ("messages.{last}.content", "input.4.content"),
    ],
)
def test_a_responses_request_is_named_by_its_input_items(instructions, chat_field, named):
    req = ResponsesRequest(model="m", input=INPUT, instructions=instructions)
    origins = Origins()
    chat = responses_chat_of(req, input_messages(INPUT, origins=origins), origins)
    assistant = next(i for i, m in enumerate(chat.messages) if m.role == "assistant")
    field = chat_field.format(at=assistant, last=len(chat.messages) - 1)
    error = renamed(origins.named(error_at(field)), RESPONSES_NAMES)
    assert (error.param, error.message) == (named, f"{named}: wrong")


def test_a_previous_responses_turns_and_the_instructions_are_named_as_those_fields():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    origins = Origins()
    for _ in history:
        origins.add("previous_response_id", calls_at="previous_response_id")
    messages = history + input_messages("Next", history, origins=origins)
    responses_chat_of(ResponsesRequest(model="m", input="Next", instructions="Be brief."), messages, origins)
    named = [renamed(origins.named(error_at(f"messages.{i}")), RESPONSES_NAMES).param for i in range(4)]
    assert named == ["instructions", "previous_response_id", "previous_response_id", "input"]


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_messages_request_is_named_by_its_messages_and_blocks(system):
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    req = MessagesRequest(
        model="m",
        max_tokens=4,
        system=system,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
    )
    origins = Origins()
    chat = messages_chat_of(req, origins)
    assistant = next(i for i, m in enumerate(chat.messages) if m.role == "assistant")
    calls = renamed(origins.named(error_at(f"messages.{assistant}.tool_calls")), MESSAGES_NAMES)
    assert calls.param == "messages.1.content.1"
    result = renamed(origins.named(error_at(f"messages.{assistant + 1}.tool_call_id")), MESSAGES_NAMES)
    assert result.param == "messages.2.tool_call_id"
    if system:
        assert origins.named(error_at("messages.0")).param == "system"


def test_a_responses_own_output_sent_back_is_one_assistant_turn():
    """Text, a call and more text (the output items of one response, in the order written) are the one turn
    the model wrote: its text joined, its call beside it, the call's result after it."""
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello.\n"}]},
        CALL,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bye."}]},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = input_messages([{"role": "user", "content": "Weather?"}, *output])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Hello.\nBye." and messages[1]["tool_calls"][0]["id"] == "c1"
