"""The Gumbel draw's uniform stays below 1. In float32, (k + 0.5) / 2**24 for the hash's top 24-bit
value k = 2**24 - 1 rounded to exactly 1.0: that token's noise was +inf, so a token masked to -inf (a
grammar's, top-k/top-p's, min_tokens' ban) drew -inf + inf = NaN, which argmax takes, and any other
token was drawn whatever its probability. About one (row, token) in 2**24 hits it: a step of the tiny
model (360 tokens) in 47,000, a step of Qwen3 (151,936 tokens) in 110. It surfaced as four constrained
chats at once sampling a token their grammar forbids (`its grammar rejected token N`)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import checked_llm

from cluster import GrammarSpec, SamplingParams
from worker.sampling.sampler import gumbel_noise, row_keys, sample_unfiltered

# (seed, position, token) whose hash has all top 24 bits set: the uniform that rounded to 1.0
TOP_UNIFORM = [(9247, 8, 167), (5635, 11, 287)]
VOCAB = 360  # the tiny checkpoints' vocabulary
DIGITS = list(range(18, 28))  # the tiny tokenizer's "0".."9"


def _digits_only(seed: int, pos: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    x = torch.full((1, VOCAB), float("-inf"))
    x[0, DIGITS] = torch.randn(len(DIGITS))
    return x, torch.ones(1), torch.tensor([seed]), torch.tensor([pos])


@pytest.mark.parametrize("seed,pos,token", TOP_UNIFORM)
def test_the_top_uniform_gives_finite_noise(seed, pos, token):
    noise = gumbel_noise(row_keys(torch.tensor([seed]), torch.tensor([pos])), VOCAB)[0]
    assert torch.isfinite(noise).all()
    assert noise.argmax() == token and noise[token] < 17  # still the row's largest: -log(-log(1 - 2**-24))


@pytest.mark.parametrize("seed,pos,token", TOP_UNIFORM)
def test_a_masked_token_is_never_drawn_at_the_top_uniform(seed, pos, token):
    x, temperature, seeds, positions = _digits_only(seed, pos)
    assert int(sample_unfiltered(x, temperature, seeds, positions)) in DIGITS
    triton_ops = pytest.importorskip("worker.triton_ops")
    pytest.importorskip("triton")
    assert int(triton_ops.sample_rows(x, temperature, seeds, positions)) in DIGITS  # the kernel's draw (interpreted)


def test_four_constrained_requests_at_once_keep_their_grammars_at_the_top_uniform(qwen3_path):
    """Four constrained requests decoding in the same steps; two are seeded so that a token their grammar
    forbids has the top uniform: in the prefill step (output token 0 at position 8) and in a decode step
    (output token 3 at position 11). Each output must be what its grammar allows."""
    integer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    schema = GrammarSpec("json_schema", json.dumps(integer))
    digits = GrammarSpec("regex", "[0-9]{12}")
    # the first two prompts are 8 tokens long: output token j is drawn at position 8 + j
    prompts = [list(range(10, 18)), list(range(20, 28)), list(range(30, 41)), list(range(40, 47))]
    params = [
        SamplingParams(temperature=1.0, seed=TOP_UNIFORM[0][0], max_tokens=12, grammar=digits),
        SamplingParams(temperature=1.0, seed=TOP_UNIFORM[1][0], max_tokens=12, grammar=digits),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, grammar=digits),
        SamplingParams(temperature=1.0, seed=2, max_tokens=30, grammar=schema),
    ]
    with checked_llm(qwen3_path, page_size=4) as llm:
        outs = llm.generate(prompts, params)  # a token a grammar rejects fails its request: generate raises
    for out in outs[:3]:
        assert len(out.token_ids) == 12 and all(t in DIGITS for t in out.token_ids), out.token_ids
    if outs[3].finish_reason == "stop":
        assert json.loads(outs[3].text)["n"] is not None


@pytest.mark.parametrize("seed,pos,token", TOP_UNIFORM)
def test_an_unlikely_token_is_not_drawn_at_the_top_uniform(seed, pos, token):
    # the noise's bound (16.6) keeps a token 40 below the rest out of the draw; +inf noise drew it
    x = torch.zeros(1, VOCAB)
    x[0, token] = -40.0
    args = (torch.ones(1), torch.tensor([seed]), torch.tensor([pos]))
    assert int(sample_unfiltered(x, *args)) != token
    triton_ops = pytest.importorskip("worker.triton_ops")
    pytest.importorskip("triton")
    assert int(triton_ops.sample_rows(x, *args)) != token
