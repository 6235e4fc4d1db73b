"""A completion of several prompts (`prompt` as a list of strings or of token-id lists), with the real
openai client and as lm-evaluation-harness sends it: each prompt runs as its own request, routed on its
own, and each choice equals what its prompt gives alone; choices are indexed prompt by prompt, usage is
summed, streams included; one bad prompt is a 400 before any runs."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fixtures import PROMPT_TEXTS
from helpers import client, serving
from test_serve import check_replicas_whole, wait_until_idle

from cluster.model_info import load_tokenizer

PROMPTS = [PROMPT_TEXTS[1], PROMPT_TEXTS[4], PROMPT_TEXTS[7]]
SAMPLED = dict(model="tiny", max_tokens=6, temperature=1, seed=11, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def srv(ray_cluster, qwen3_path):
    with serving(qwen3_path, replicas=2, num_pages=1024, max_running_reqs=32) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(qwen3_path):
    return load_tokenizer(str(qwen3_path))


def by_index(choices) -> list:
    return sorted(choices, key=lambda c: c.index)


def alone(srv, prompts, **kw) -> list:
    """Each prompt's choices when it is sent by itself, in the order a list request indexes them."""
    return [c for p in prompts for c in by_index(client(srv).completions.create(prompt=p, **kw).choices)]


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-id-lists"])
def test_each_choice_of_a_prompt_list_equals_its_prompt_alone(srv, tokenizer, as_ids):
    prompts = [tokenizer(p).input_ids for p in PROMPTS] if as_ids else PROMPTS
    r = client(srv).completions.create(prompt=prompts, n=2, **SAMPLED)
    expected = alone(srv, prompts, n=2, **SAMPLED)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for c in expected]
    assert [c.finish_reason for c in r.choices] == ["length"] * 6
    assert r.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in PROMPTS)
    assert r.usage.completion_tokens == 6 * 6
    check_replicas_whole(srv)


def test_one_token_id_list_stays_one_prompt(srv, tokenizer):
    ids = tokenizer(PROMPTS[0]).input_ids
    r = client(srv).completions.create(prompt=ids, **SAMPLED)
    assert len(r.choices) == 1 and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == alone(srv, [PROMPTS[0]], **SAMPLED)[0].text


def test_a_streamed_prompt_list_carries_each_choices_index(srv):
    expected = client(srv).completions.create(prompt=PROMPTS, n=2, **SAMPLED)
    stream = client(srv).completions.create(
        prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    texts, reasons, usage = [""] * 6, [None] * 6, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in expected.choices]
    assert reasons == ["length"] * 6
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-id-lists"])
def test_lm_eval_loglikelihood_batch_equals_each_prompt_alone(srv, tokenizer, as_ids):
    """What lm-evaluation-harness sends for loglikelihoods with a batch size above 1."""
    prompts = [tokenizer(p).input_ids for p in PROMPTS] if as_ids else PROMPTS
    args = dict(model="tiny", echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    r = client(srv).completions.create(prompt=prompts, **args)
    expected = alone(srv, prompts, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for got, exp, prompt in zip(r.choices, expected, PROMPTS):
        n = len(tokenizer(prompt).input_ids)
        assert got.text == exp.text
        assert got.logprobs.tokens == exp.logprobs.tokens and len(got.logprobs.tokens) == n + 1
        assert got.logprobs.token_logprobs[0] is None
        assert got.logprobs.token_logprobs[1:] == pytest.approx(exp.logprobs.token_logprobs[1:], abs=1e-5)
        for top, exp_top in zip(got.logprobs.top_logprobs[1:], exp.logprobs.top_logprobs[1:]):
            assert top.keys() == exp_top.keys()
            assert list(top.values()) == pytest.approx(list(exp_top.values()), abs=1e-5)


def test_prompts_of_one_request_are_routed_independently(srv, tokenizer):
    import ray

    before = [s.prompt_tokens_admitted for s in wait_until_idle(srv)]
    prompts = [f"{PROMPT_TEXTS[i]} {i}" for i in range(6)]
    client(srv).completions.create(prompt=prompts, model="tiny", max_tokens=2)
    after = [s.prompt_tokens_admitted for s in ray.get([r.actor.stats.remote() for r in srv.replicas])]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # each replica ran some of them
    assert sum(after) - sum(before) == sum(len(tokenizer(p).input_ids) for p in prompts)


@pytest.mark.parametrize(
    "prompt",
    [
        [PROMPT_TEXTS[0], ""],  # an empty one
        [PROMPT_TEXTS[0], "hello " * 2000],  # one over the context
        [[1, 2, 3], [4, 10**6]],  # a token id outside the vocabulary
        [[1, 2, 3], []],
    ],
    ids=["empty", "too-long", "bad-token", "empty-ids"],
)
def test_one_bad_prompt_is_a_400_before_any_runs(srv, prompt):
    issued = srv.state.uids.issued
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "prompt 1" in err["message"], err
    assert srv.state.uids.issued == issued  # no prompt was sent to a replica


@pytest.mark.parametrize(
    "prompt, where, says",
    [
        (["Hello", None], "prompt.1", "valid string"),  # a list of strings whose second is not one
        ([[1, 2], "ok"], "prompt.1", "valid list"),  # a list of token lists whose second is not one
        (["ok", [5]], "prompt.1", "valid string"),
        ([[1, "x"], [2]], "prompt.0.1", "valid integer"),
        (["a", 1, None], "prompt.1", "valid string"),  # strings got furthest before their first error
    ],
)
def test_a_prompt_of_the_wrong_type_in_a_list_is_the_one_named(srv, prompt, where, says):
    """The list's kind is its first prompt's: the 400 names the element that breaks it, not the first."""
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == where and says in err["message"], err


def test_a_client_gone_mid_stream_aborts_every_prompt(srv):
    decoded_before = sum(s.decode_tokens for s in wait_until_idle(srv))

    async def leave_early() -> None:
        aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        stream = await aclient.completions.create(
            model="tiny", prompt=PROMPTS, max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in stream:
            break
        await stream.close()
        await aclient.close()

    asyncio.run(leave_early())
    stats = wait_until_idle(srv)
    assert sum(s.decode_tokens for s in stats) - decoded_before < 450  # of 900: the aborts landed early
    check_replicas_whole(srv)


class _NoDecode:
    """A tokenizer that must not be asked to decode."""

    def decode(self, ids):
        raise AssertionError("decoded a prompt the request does not echo")


@pytest.mark.parametrize("echo", [None, False])
def test_a_prompt_of_ids_is_decoded_only_for_an_echo(echo):
    from router.http.prompts import completion_prompts
    from router.http.protocol import CompletionRequest

    body = CompletionRequest(model="m", prompt=[[5, 6, 7], [8, 9]], echo=echo)
    prompts = completion_prompts(body, _NoDecode(), vocab_size=100, max_seq_len=64)
    assert [(p.ids, p.text) for p in prompts] == [([5, 6, 7], None), ([8, 9], None)]
