"""Shared test helpers: building an LLM on a fixture checkpoint and checking it afterwards."""

from __future__ import annotations

from contextlib import contextmanager

from cluster import LLM, SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@contextmanager
def checked_llm(path, **kw):
    """An LLM whose page allocator must be whole when the test is done with it."""
    llm = LLM(str(path), **kw)
    try:
        yield llm
        llm.check_integrity()
        stats = llm.stats()
        assert stats["live"] == 0, "requests left running"
        assert stats["slots_free"] == stats["slots_total"], "request slots leaked"
    finally:
        llm.shutdown()


def encode_all(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.tokenizer(t).input_ids for t in texts]
