"""Shared test helpers: building an LLM on a fixture checkpoint and checking it afterwards."""

from __future__ import annotations

from contextlib import contextmanager

from cluster import LLM, SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_tp2_equals_tp1(path, prompts: list[list[int]], max_tokens: int, **kw) -> None:
    """Greedy tokens at tp 2 (real Ray, gloo) equal tp 1's, and their logprobs within 1e-4."""
    import pytest

    params = greedy(max_tokens, ignore_eos=True, logprobs=0)
    runs = []
    for tp_size in (2, 1):
        with checked_llm(path, tp_size=tp_size, page_size=4, **kw) as llm:
            runs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)])
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    flat = [[x for _, lps in run for x in lps] for run in runs]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)


@contextmanager
def checked_llm(path, **kw):
    """An LLM whose page allocator must be whole when the test is done with it."""
    llm = LLM(str(path), **kw)
    try:
        yield llm
        llm.check_integrity()
        stats = llm.stats()
        assert stats.live == 0, "requests left running"
        assert stats.request_slots_free == stats.request_slots_total, "request slots leaked"
    finally:
        llm.shutdown()


def gated_calls(monkeypatch, module, name: str) -> list[bool]:
    """Wraps module.name (a GEMV launcher) for the test: the returned list grows by each call's `gated`."""
    calls: list[bool] = []
    real = getattr(module, name)

    def counted(*args, **kw):
        calls.append(kw.get("gated", False))
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def encode_all(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.tokenizer(t).input_ids for t in texts]


def client(srv):
    """The real `openai` client of a server from `serving`."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model_path, **config):
    """A real HTTP server on 127.0.0.1 over replicas on the session's Ray; stopped afterwards."""
    from cluster.config import ServeConfig
    from router.tier.deployment import Deployment

    config.setdefault("served_model_name", "tiny")
    config.setdefault("page_size", 4)
    config.setdefault("routers", 0)  # the router in this process, whose state the tests inspect, whatever the cores
    config.setdefault("cpu_threads", 1)  # as this process's torch (conftest.py): tiny models on a few cores
    srv = Deployment(ServeConfig().override(model=str(model_path), port=free_port(), **config))
    srv.start_in_thread()
    try:
        yield srv
    finally:
        srv.stop()


def fail_first_launch(executor, message: str = "injected kernel failure") -> None:
    """Makes the executor's next launch raise, as a kernel error would; later launches run."""
    launch = executor.launch
    calls = {"n": 0}

    def launch_or_fail(desc):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(message)
        return launch(desc)

    executor.launch = launch_or_fail


def concurrent_completions(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of every prompt at once through the async openai client (every other one
    streamed): their texts, in order."""
    import asyncio

    import openai

    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt: str, stream: bool) -> str:
        if not stream:
            r = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
            return r.choices[0].text
        chunks = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in chunks])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p, i % 2 == 0) for i, p in enumerate(prompts)))
        finally:
            await aclient.close()  # on this loop: one garbage-collected later would close on a closed loop

    return asyncio.run(all_of_them())


def migrations_counted(url: str, cause: str) -> float:
    """The server's raylm:request_migrations_total of one cause (0 before the first)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    prefix = "raylm:request_migrations_total{"
    for line in text.splitlines():
        if line.startswith(prefix) and f'cause="{cause}"' in line:
            return float(line.split()[-1])
    return 0.0
