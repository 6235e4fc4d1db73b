"""Test fixtures for chat with tools: a copy of a tiny checkpoint whose chat template renders tools
(by name), tool calls and tool results as Qwen3's does (and its enable_thinking switch), and the logit
bias that keeps random weights from filling JSON with whitespace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN3_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>"
    # Qwen3's writes each tool as JSON; the names alone keep the tiny tokenizer's prompts short
    "{% for tool in tools %}{{ '\\n' }}{{ tool.function.name }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    'Call them as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if not loop.first or message.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# a template that opens the think block itself (as DeepSeek-R1's and QwQ's do), unless told not to
# think: a model's output is then reasoning until it closes the block
OPENS_THINKING_TEMPLATE = QWEN3_TOOLS_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}",
)
assert OPENS_THINKING_TEMPLATE != QWEN3_TOOLS_TEMPLATE


# the tools' schemas make long prompts with the tiny tokenizer: the copy's context is longer
CONTEXT = 2048


def chat_checkpoint(source: Path, out_dir: Path, template: str = QWEN3_TOOLS_TEMPLATE) -> Path:
    """A copy of the checkpoint at source with `template` as its chat template."""
    shutil.copytree(source, out_dir)
    (out_dir / "chat_template.jinja").write_text(template)
    config = json.loads((out_dir / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def no_whitespace(tokenizer) -> dict[str, int]:
    """A logit_bias that bans the whitespace-only tokens. JSON allows any whitespace between its tokens,
    and random weights favour it: unbanned, a schema's output often runs into max_tokens. A grammar
    that needs a newline (a tool call's tags) still gets it: the ban is -100 on the logit, the grammar's
    mask -inf on the rest."""
    return {str(i): -100 for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()}
