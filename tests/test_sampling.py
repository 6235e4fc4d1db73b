"""The sampling surface beyond temperature/top-p/top-k, refereed by Hugging Face `generate` in float32:
repetition penalty, one-token sequence biases (logit_bias) and min_new_tokens (min_tokens) equal HF
token for token; presence and frequency penalties equal HF driven by a direct implementation of
OpenAI's formula; prompt logprobs equal HF's forward; n choices are seeded per choice, share the
prompt's prefill, and do not depend on their batch. Page integrity is checked after every run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_generate, hf_greedy, hf_prompt_logprobs
from helpers import checked_llm, encode_all, greedy
from transformers import LogitsProcessor, LogitsProcessorList

from cluster import InvalidRequestError, SamplingParams
from worker.sampling.processors import ProcessorState
from worker.sampling.sampler import filter_logits

NEW = 24  # long enough for random tiny models to repeat themselves, so penalties change the output


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition, written out: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, with c[j]
    the count of token j among the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            for token, count in zip(*np.unique(ids[self.prompt_len :].numpy(), return_counts=True)):
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def _prompts(llm, n: int = 6) -> list[list[int]]:
    return encode_all(llm, PROMPT_TEXTS[:n])


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("overlap", [True, False])
def test_repetition_penalty_equals_hf_generate(model_paths, family, overlap):
    path = model_paths[family]
    with checked_llm(path, overlap=overlap) as llm:
        prompts = _prompts(llm)
        plain = [o.token_ids for o in llm.generate(prompts, greedy(NEW, ignore_eos=True))]
        got = [o.token_ids for o in llm.generate(prompts, greedy(NEW, ignore_eos=True, repetition_penalty=1.8))]
    assert got == hf_generate(path, prompts, NEW, repetition_penalty=1.8, eos_token_id=[])
    assert got != plain  # the penalty changed something: the comparison above is not vacuous


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("overlap", [True, False])
def test_logit_bias_equals_hf_sequence_bias(model_paths, family, overlap):
    path = model_paths[family]
    with checked_llm(path, overlap=overlap) as llm:
        prompts = _prompts(llm)
        plain = llm.generate(prompts, greedy(NEW, ignore_eos=True))
        # push down the tokens plain greedy likes, and pull up two it never picked
        liked = sorted({t for o in plain for t in o.token_ids[:4]})[:6]
        bias = {t: -4.0 for t in liked} | {7: 3.5, 11: 2.0}
        got = [o.token_ids for o in llm.generate(prompts, greedy(NEW, ignore_eos=True, logit_bias=bias))]
    assert got == hf_generate(path, prompts, NEW, eos_token_id=[], sequence_bias={(t,): b for t, b in bias.items()})
    assert got != [o.token_ids for o in plain]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("overlap", [True, False])
def test_min_tokens_equals_hf_min_new_tokens(model_paths, family, overlap):
    path = model_paths[family]
    with checked_llm(path, overlap=overlap) as llm:
        prompts = _prompts(llm)
        plain = llm.generate(prompts, greedy(NEW, ignore_eos=True))
        # a stop id that plain greedy emits early, so that holding it back changes the argmax
        stop = plain[0].token_ids[2]
        eos = sorted(llm.scheduler.eos_ids)
        got = llm.generate(prompts, greedy(NEW, stop_token_ids=[stop], min_tokens=8))
        early = llm.generate(prompts, greedy(NEW, stop_token_ids=[stop]))
    assert [o.token_ids for o in got] == hf_generate(path, prompts, NEW, min_new_tokens=8, eos_token_id=eos + [stop])
    assert len(early[0].token_ids) == 3 and len(got[0].token_ids) > 8
    assert all(len(o.token_ids) >= 8 for o in got)


@pytest.mark.parametrize("family,overlap", [("qwen3", True), ("llama", False), ("qwen2", True)])
def test_presence_and_frequency_penalties_equal_openais_formula(model_paths, family, overlap):
    path = model_paths[family]
    with checked_llm(path, overlap=overlap) as llm:
        prompts = _prompts(llm)
        plain = [o.token_ids for o in llm.generate(prompts, greedy(NEW, ignore_eos=True))]
        for presence, frequency in ((0.0, 1.5), (1.2, 0.0), (0.7, 0.6), (-0.5, 0.0)):
            got = [
                o.token_ids
                for o in llm.generate(
                    prompts, greedy(NEW, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
                )
            ]
            ref = hf_generate(
                path,
                prompts,
                NEW,
                eos_token_id=[],
                logits_processor=lambda n: LogitsProcessorList([OpenAIPenalties(n, presence, frequency)]),
            )
            assert got == ref, (presence, frequency)
            if presence > 0 or frequency > 0:
                assert got != plain


@pytest.mark.parametrize(
    "overlap,cache_type,page_size,chunk",
    [(True, "radix", 4, 8), (False, "naive", 1, 8192), (True, "naive", 16, 5), (False, "radix", 4, 8192)],
)
def test_a_batch_mixing_processors_and_plain_rows_equals_hf_row_by_row(
    qwen3_path, overlap, cache_type, page_size, chunk
):
    """Rows with processors and rows without share batches (and request slots, one after another):
    each equals its own HF run; chunked prefill, page sizes and both caches included."""
    with checked_llm(
        qwen3_path,
        overlap=overlap,
        cache_type=cache_type,
        page_size=page_size,
        max_extend_tokens=chunk,
        max_running_reqs=4,
    ) as llm:
        prompts = _prompts(llm, 8)
        mixed = [
            greedy(NEW, ignore_eos=True, repetition_penalty=1.5, logit_bias={9: 2.0})
            if i % 2
            else greedy(NEW, ignore_eos=True)
            for i in range(len(prompts))
        ]
        got = [o.token_ids for o in llm.generate(prompts, mixed)]
        again = [o.token_ids for o in llm.generate(prompts, mixed)]  # slots reused, prefix cache warm
    penalized = hf_generate(
        qwen3_path, prompts[1::2], NEW, eos_token_id=[], repetition_penalty=1.5, sequence_bias={(9,): 2.0}
    )
    assert got[1::2] == again[1::2] == penalized
    assert got[0::2] == again[0::2] == hf_greedy(qwen3_path, prompts[0::2], NEW, ignore_eos=True)


def test_penalties_survive_preemption(qwen3_path):
    """A preempted request is prefilled again over all its tokens: its counts are rebuilt from them."""
    with checked_llm(qwen3_path, page_size=4, num_pages=48, decode_reserve_tokens=1) as llm:
        prompts = _prompts(llm, 8)
        params = greedy(NEW, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats().preempted > 0
    ref = hf_generate(
        qwen3_path,
        prompts,
        NEW,
        eos_token_id=[],
        logits_processor=lambda n: LogitsProcessorList([OpenAIPenalties(n, 0.5, 1.0)]),
    )
    assert got == ref


def test_seeded_choices_are_reproducible_and_independent_of_the_batch(qwen3_path):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    with checked_llm(qwen3_path) as llm:
        prompt = _prompts(llm, 1)[0]
        first = llm.generate([prompt], params)[0]
        alone = [o.token_ids for o in first.outputs]
        # the same request again, now beside other requests (sampled and greedy)
        others = _prompts(llm, 3)[1:]
        crowd = llm.generate(
            [prompt, others[0], prompt, others[1]],
            [params, greedy(12), params.for_choice(1), SamplingParams(temperature=0.7, seed=5)],
        )
        in_crowd = [o.token_ids for o in crowd[0].outputs]
        singles = [llm.generate([prompt], params.for_choice(i))[0].token_ids for i in range(3)]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert alone == in_crowd == singles
    assert len({tuple(t) for t in alone}) == 3  # three different seeds, three different samples
    assert crowd[2].token_ids == alone[1]


def test_choices_share_the_prompts_prefill(qwen3_path):
    with checked_llm(qwen3_path, page_size=4) as llm:
        prompt = encode_all(llm, [PROMPT_TEXTS[0] * 3])[0]
        before = llm.stats()
        out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4, n=4, seed=9))[0]
        after = llm.stats()
    assert len(out.outputs) == 4
    computed = after.prefill_tokens - before.prefill_tokens
    # the prompt once, and at most one page of it again per later choice (the page its last token is in)
    assert computed <= len(prompt) + 3 * 4
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 3 * (len(prompt) - 4)


def test_prompt_logprobs_equal_hf_forward(qwen3_path):
    with checked_llm(qwen3_path, max_extend_tokens=7, page_size=4) as llm:  # chunked: scored across chunks
        prompts = _prompts(llm, 3)
        llm.generate(prompts, greedy(2))  # the prompts now sit in the prefix cache: scoring must not use it
        outs = llm.generate(prompts, greedy(2, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) - 1
        ref = hf_prompt_logprobs(qwen3_path, prompt)
        targets = torch.tensor(prompt[1:]).unsqueeze(1)
        assert torch.allclose(torch.tensor([lp for lp, _ in got]), ref.gather(1, targets).squeeze(1), atol=1e-4)
        values, ids = ref.topk(3, dim=-1)
        assert [[i for i, _ in top] for _, top in got] == ids.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in top] for _, top in got]), values, atol=1e-4)


def test_offline_output_logprobs_hold_the_k_most_likely_as_hf_forward_does(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        prompts = _prompts(llm, 2)
        outs = llm.generate(prompts, greedy(5, ignore_eos=True, logprobs=3))
    for prompt, out in zip(prompts, outs):
        ids, top = out.token_ids, out.outputs[0].top_logprobs
        ref = hf_prompt_logprobs(qwen3_path, prompt + ids)[len(prompt) - 1 :]  # the rows that chose the output
        values, best = ref.topk(3, dim=-1)
        assert len(top) == len(ids) and [[i for i, _ in t] for t in top] == best.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in t] for t in top]), values, atol=1e-4)
        assert [t[0][0] for t in top] == ids  # greedy: the most likely is the one sampled


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.3, 0.9, 1.0])
    got = filter_logits(logits, temperature, torch.ones(5), torch.full((5,), -1, dtype=torch.int32), min_p)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(torch.isfinite(got), keep)
    assert torch.equal(got[keep], logits[keep])


def test_processor_state_applies_openais_formula_and_leaves_plain_rows_untouched():
    torch.manual_seed(1)
    vocab, slots = 40, 4
    state = ProcessorState(slots, vocab, 8, torch.device("cpu"))
    generated = {0: [3, 3, 5, 7, 3], 2: [1, 1, 39]}
    for slot, tokens in generated.items():
        state.update(torch.tensor([slot] * len(tokens)), torch.tensor(tokens))
    logits = torch.randn(3, vocab)
    rows = torch.tensor([0, state.scratch_row, 2])
    presence, frequency = torch.tensor([0.5, 0.0, -1.0]), torch.tensor([1.5, 0.0, 0.25])
    got = state.apply(logits, rows, presence, frequency, torch.ones(3), torch.zeros(3, dtype=torch.bool))
    expect = logits.clone()
    for row, slot in ((0, 0), (2, 2)):
        for token in set(generated[slot]):
            expect[row, token] -= generated[slot].count(token) * frequency[row] + presence[row]
    assert torch.allclose(got, expect)
    assert torch.equal(got[1], logits[1])  # the scratch row: no state, exactly the logits


def test_bad_values_name_their_field(qwen3_path):
    for kw, field in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"n": 0}, "n"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field
    with checked_llm(qwen3_path, max_logit_bias=4) as llm:
        prompt = _prompts(llm, 1)
        vocab = llm.engine.hf_config.vocab_size
        for kw in (
            {"logit_bias": {vocab: 1.0}},
            {"logit_bias": {i: 1.0 for i in range(5)}},
            {"logit_bias": {1: 1.0, 2: 1.0}, "min_tokens": 2, "stop_token_ids": [3, 4, 5]},
        ):
            with pytest.raises(InvalidRequestError) as e:
                llm.generate(prompt, greedy(4, **kw))
            assert e.value.field == "logit_bias"
        assert llm.generate(prompt, greedy(4, logit_bias={i: 1.0 for i in range(4)}))[0].finish_reason
