"""Chat requests: rendering them with the chat template, their grammars, and reading the output back
(detokenizing, reasoning, tool calls)."""
