"""Mixed steps: every running decode rides along with the prompt chunks that fit the token budget, so
a long prompt never stalls running decodes (with mixing off, each of its chunks stalls them a step);
the output equals Hugging Face across families, loops, caches, chunk and page sizes, with requests
arriving while others decode; pages and slots are whole after every run."""

from __future__ import annotations

import pytest
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy

from cluster import SamplingParams


def _stalls(run, uids: list[int]) -> int:
    """Steps in which some request of `uids` got no row between its first step and its last."""
    stalled: set[int] = set()
    for uid in uids:
        mine = [i for i, (_, reqs) in enumerate(run.steps) if uid in reqs]
        stalled |= set(range(mine[0], mine[-1])) - set(mine)
    return len(stalled)


def _record_steps(run):
    """Keeps, per launched step, the uids of its rows."""
    run.steps = []
    launch = run.scheduler._launch

    def recording(batch):
        run.steps.append((batch.desc, [r.uid for r in batch.reqs]))
        return launch(batch)

    run.scheduler._launch = recording


@pytest.mark.parametrize("overlap", [True, False])
def test_a_long_prompt_does_not_stall_running_decodes(scripted, overlap):
    stalls = {}
    for mixed in (True, False):
        run = scripted(max_extend_tokens=32, overlap=overlap, mixed_steps=mixed, num_pages=512)
        _record_steps(run)
        for uid in range(4):
            run.submit(uid, list(range(1, 9)), max_tokens=80, ignore_eos=True)  # they outlast the long prefill
        for _ in range(4):  # the four are decoding
            run.scheduler.step()
        run.submit(99, list(range(300, 499)), max_tokens=4, ignore_eos=True)  # 199 tokens, no prefix in common
        run.run()
        run.check()
        assert all(len(run.tokens(uid)) == 80 for uid in range(4)) and len(run.tokens(99)) == 4
        prefill_steps = [d for d, reqs in run.steps if 99 in reqs and d.is_prefill]
        assert all(d.num_tokens <= 32 for d in prefill_steps)  # the budget holds the decodes' tokens and the chunk
        assert len(prefill_steps) == (8 if mixed else 7)  # 199 tokens in chunks of 28 (beside 4 decodes) or 32
        if mixed:
            assert run.scheduler.snapshot().mixed_steps == 8
        stalls[mixed] = _stalls(run, list(range(4)))
    assert stalls[True] == 0
    assert stalls[False] >= 7


@pytest.mark.parametrize(
    "family,overlap,cache_type,page_size,chunk",
    [
        ("qwen3", True, "radix", 4, 16),
        ("qwen3", False, "naive", 1, 7),
        ("llama", True, "naive", 16, 8192),
        ("llama", False, "radix", 4, 9),
        ("qwen2", True, "radix", 1, 12),
        ("qwen3_moe", True, "radix", 4, 9),
        ("mixtral", False, "naive", 1, 7),
    ],
)
def test_mixed_steps_with_arrivals_equal_hf(model_paths, family, overlap, cache_type, page_size, chunk):
    """Three requests at a time: each new one is prefilled (in chunks) beside the others' decodes."""
    path = model_paths[family]
    with checked_llm(
        path, overlap=overlap, cache_type=cache_type, page_size=page_size, max_extend_tokens=chunk, max_running_reqs=3
    ) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        params = [greedy(8 + 3 * (i % 3), ignore_eos=True) for i in range(8)]  # ends at different steps
        outs = llm.generate(prompts, params)
        assert llm.stats().mixed_steps > 0
    for i, out in enumerate(outs):
        assert out.token_ids == hf_greedy(path, [prompts[i]], 8 + 3 * (i % 3), ignore_eos=True)[0]


def test_mixed_steps_keep_seeded_sampling_and_preemption_exact(qwen3_path):
    """The same seeded requests give the same tokens with mixing on and off, preempting on the way."""
    params = [
        SamplingParams(temperature=0.9, top_k=30, max_tokens=24, ignore_eos=True, seed=i, presence_penalty=0.3)
        for i in range(8)
    ]
    results = []
    for mixed in (True, False):
        with checked_llm(
            qwen3_path,
            page_size=4,
            num_pages=30,
            decode_reserve_tokens=1,
            max_running_reqs=4,
            mixed_steps=mixed,
            max_extend_tokens=10,
        ) as llm:
            prompts = encode_all(llm, PROMPT_TEXTS[:8])
            results.append([o.token_ids for o in llm.generate(prompts, params)])
            assert llm.stats().preempted > 0
    assert results[0] == results[1]
