"""The context a model is served at, from its config alone (no torch): what launch-time checks and the
engine both read. The engine attends every earlier token of a sequence; a model whose attention is windowed
(`sliding_window`: Mistral-7B-v0.1, Mixtral and Qwen configs with `use_sliding_window`) attends only the last
`sliding_window` of them, which is the same attention only while a whole sequence fits in the window."""

from __future__ import annotations

from collections.abc import Mapping


def sliding_window_of(config) -> int | None:
    """The window of a model's windowed attention layers, from its config.json's dict or its transformers
    config; None where every layer attends the whole context. Qwen's configs carry a `sliding_window` that
    applies only with `use_sliding_window`; a `layer_types` list (transformers' per-layer kinds) names the
    windowed layers, if any."""
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    window = get("sliding_window")
    if window is None or get("use_sliding_window") is False:
        return None
    types = get("layer_types")
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


class WindowedAttentionError(ValueError):
    """A context longer than the model's attention window was asked for."""


def served_context(asked: int | None, positions: int, window: int | None) -> tuple[int, bool]:
    """(the context served, whether the window cut it): `asked` (max_seq_len) or else the model's positions,
    at most the window of a windowed model. Asking for more than the window is an error, not a cut."""
    context = asked or positions
    if window is None or context <= window:
        return context, False
    if asked:
        raise WindowedAttentionError(
            f"max_seq_len {asked} is longer than this model's attention window of {window} tokens (its "
            f"sliding_window): windowed attention is not implemented, so sequences are served up to the window; "
            f"set max_seq_len to at most {window}"
        )
    return window, True
