"""A chat request made ready to run: its prompt (the template renders the messages and tools), the
grammar its output follows (a response_format, a guided_* field, or a forced tool call) and how its
output is read back (reasoning, tool calls)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster import GrammarSpec
from router.chat.output import ChatOutput
from router.chat.reasoning import closes_thinking, opens_thinking
from router.chat.structured import request_grammar
from router.chat.tools import plan_tools, strict_field, tool_grammar
from router.http.errors import APIError
from router.http.protocol import ChatCompletionRequest
from router.http.state import RouterState


@dataclass(frozen=True)
class PreparedChat:
    ids: list[int]
    grammar: GrammarSpec | None
    output: ChatOutput


def prepare_chat(state: RouterState, req: ChatCompletionRequest, counting: bool = False) -> PreparedChat:
    """The request's prompt ids, grammar and output reading, or a 400 naming the field at fault. `counting`:
    for its prompt's tokens alone (/tokenize, count_tokens), where tools a template does not render are
    no error: the count is of the prompt the model would see."""
    tools = plan_tools(req, state.tool_call_parser)
    grammar = request_grammar(req)
    if grammar is not None and tools.forced:
        raise APIError(
            400,
            "tool_choice asks for a tool call, which cannot be combined with a response_format "
            "or guided_* field (both constrain the whole output)",
            param="tool_choice",
        )
    if grammar is not None and tools.strict:
        field = strict_field(req)
        raise APIError(
            400,
            f"{field}: a strict function under tool_choice auto cannot be combined with a response_format or "
            "guided_* field (the format constrains the whole output: no call could be written)",
            param=field,
        )
    # the model must see the tools to choose a call under "auto" ("none": it calls none; forced: a grammar
    # writes the call)
    seen = not counting and not tools.forced and req.tool_choice != "none"
    prompt = state.chat_prompt(req, tools=tools.template_tools, tools_seen=seen)
    # the template writes the special tokens; add_special_tokens (vLLM's) adds the tokenizer's too
    ids = state.tokenizer(prompt, add_special_tokens=bool(req.add_special_tokens)).input_ids
    reasoning = state.reasoning_parser is not None
    thinking = reasoning and (req.chat_template_kwargs or {}).get("enable_thinking") is not False
    # a requested format is the whole output: it never sits inside a think block the prompt opened
    in_think = thinking and grammar is None and opens_thinking(prompt)
    # a strict function under "auto" constrains the calls the model opens, the text around them free
    if tools.forced or tools.strict:
        mode = "enabled" if in_think else "disabled" if not thinking or closes_thinking(prompt) else "auto"
        grammar = tool_grammar(req, state.tool_call_parser, mode)
    # calls are read unless the output follows a format of the client's own
    reads_calls = tools.parse and (tools.forced or tools.strict or grammar is None)
    output = ChatOutput(
        reasoning=reasoning,
        starts_in_reasoning=in_think,
        tool_calls=state.tool_call_parser if reads_calls else None,
        max_calls=1 if req.parallel_tool_calls is False else None,
        shows_reasoning=req.include_reasoning is not False,
    )
    return PreparedChat(ids, grammar, output)
