"""vLLM's allowed_token_ids: only the tokens of a set may be sampled. Greedy output equals transformers'
generate with every other token suppressed (SuppressTokensLogitsProcessor) in float32, under overlap and
speculation alike; sampled tokens stay in the set; a bad set is refused naming the field."""

from __future__ import annotations

import pytest
from fixtures import PROMPT_TEXTS, hf_generate
from helpers import checked_llm, encode_all
from test_spec_decode import SPEC
from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

from cluster import InvalidRequestError, SamplingParams
from cluster.sampling_params import GrammarSpec


def _allowed(llm, prompts: list[list[int]]) -> list[int]:
    """A set of 40 tokens: some the prompts hold (so that greedy output has likely ones among them), the
    end-of-text token left out."""
    eos = set(llm.scheduler.eos_ids)
    seen = sorted({t for p in prompts for t in p} - eos)
    return seen[::3][:40]


@pytest.mark.parametrize("setting", ["overlap", "no_overlap", "ngram"])
def test_greedy_output_within_the_set_equals_hf_with_the_rest_suppressed(qwen3_path, setting):
    kw = {"overlap": setting != "no_overlap", **(SPEC if setting == "ngram" else {})}
    with checked_llm(qwen3_path, dtype="float32", num_pages=512, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        allowed = _allowed(llm, prompts)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        vocab = llm.engine.hf_config.vocab_size
    suppressed = [t for t in range(vocab) if t not in set(allowed)]
    want = hf_generate(
        qwen3_path,
        prompts,
        12,
        eos_token_id=[],
        logits_processor=lambda n: LogitsProcessorList([SuppressTokensLogitsProcessor(suppressed, device="cpu")]),
    )
    assert got == want
    assert all(set(g) <= set(allowed) for g in got)


def test_sampled_tokens_stay_in_the_set(qwen3_path):
    with checked_llm(qwen3_path, num_pages=512) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:4])
        allowed = _allowed(llm, prompts)[:5]
        params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=3, n=3, allowed_token_ids=allowed)
        outs = [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]
    assert all(len(o) == 16 and set(o) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o}) > 1  # sampled, not one token over and over


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"allowed_token_ids": []}, "must not be empty"),
        ({"allowed_token_ids": [1, 10**6]}, "outside this model's vocabulary"),
        ({"allowed_token_ids": [1, "2"]}, "token ids are integers"),
        ({"allowed_token_ids": [1], "grammar": GrammarSpec("regex", "a+")}, "cannot be combined with a grammar"),
    ],
)
def test_a_bad_set_is_refused_naming_allowed_token_ids(qwen3_path, kw, says):
    with checked_llm(qwen3_path, num_pages=64) as llm:
        with pytest.raises(InvalidRequestError, match=says) as e:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **kw))
    assert e.value.field == "allowed_token_ids"
