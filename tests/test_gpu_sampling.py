"""The logits processors on the GPU: Hugging Face parity in float32 (eager), and inside the decode CUDA
graphs in bfloat16: the processor variant of a bucket applies them (a +100 bias forces its token, a
penalty changes the output as it does eagerly), rows without them in the same batch draw exactly what
they draw alone, and the overlap loop (which launches step N+1 before step N's token is known on the
host) gives what the normal loop gives."""

from __future__ import annotations

import pytest
from fixtures import PROMPT_TEXTS, hf_generate
from helpers import checked_llm, encode_all, greedy
from test_gpu import KV_TOKENS, agreement, qwen3_hd128_path, random_prompts, run  # noqa: F401

from cluster import SamplingParams
from worker.kernels import Kernels

pytestmark = pytest.mark.gpu


def test_processors_on_gpu_equal_hf_in_float32(model_paths):
    path = model_paths["qwen3"]
    with checked_llm(path, device="cuda", dtype="float32", kernels=Kernels(attention="torch")) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        got = [
            o.token_ids
            for o in llm.generate(prompts, greedy(24, ignore_eos=True, repetition_penalty=1.8, logit_bias={7: 3.0}))
        ]
    assert got == hf_generate(path, prompts, 24, eos_token_id=[], repetition_penalty=1.8, sequence_bias={(7,): 3.0})


def test_a_forcing_bias_holds_in_graph_decode_steps(qwen3_hd128_path):
    prompts = random_prompts(5, 5, 60, seed=6)
    params = [
        greedy(20, ignore_eos=True, logit_bias={42: 100.0}) if i % 2 else greedy(20, ignore_eos=True) for i in range(5)
    ]
    got, _ = run(qwen3_hd128_path, prompts, params, dtype="bfloat16", page_size=16)
    plain, _ = run(qwen3_hd128_path, prompts, greedy(20, ignore_eos=True), dtype="bfloat16", page_size=16)
    assert all(t == [42] * 20 for t in got[1::2])
    assert got[0::2] == plain[0::2]


def test_penalties_in_graphs_agree_with_eager_and_leave_plain_sampled_rows_alone(qwen3_hd128_path):
    prompts = random_prompts(8, 5, 80, seed=7)
    sampled = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=20 + i) for i in range(8)]
    mixed = [
        SamplingParams(
            temperature=0.8,
            max_tokens=24,
            ignore_eos=True,
            seed=20 + i,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            min_p=0.05,
        )
        if i % 2
        else p
        for i, p in enumerate(sampled)
    ]
    alone, _ = run(qwen3_hd128_path, prompts, sampled, dtype="bfloat16", page_size=16)
    graph, _ = run(qwen3_hd128_path, prompts, mixed, dtype="bfloat16", page_size=16)
    eager, _ = run(qwen3_hd128_path, prompts, mixed, dtype="bfloat16", page_size=16, cuda_graph_max_bs=0)
    assert graph[0::2] == alone[0::2]
    assert agreement(eager, graph) >= 0.95
    assert graph[1::2] != alone[1::2]


def test_overlap_equals_normal_loop_with_penalties_and_min_tokens(qwen3_hd128_path):
    prompts = random_prompts(10, 5, 150, seed=8)
    params = [
        SamplingParams(
            temperature=0.7, max_tokens=32, seed=5 + i, frequency_penalty=0.8, min_tokens=12, logit_bias={3: -100.0}
        )
        for i in range(10)
    ]
    normal, _ = run(qwen3_hd128_path, prompts, params, dtype="bfloat16", page_size=16, overlap=False)
    overlap, _ = run(qwen3_hd128_path, prompts, params, dtype="bfloat16", page_size=16, overlap=True)
    assert overlap == normal
    assert all(len(t) >= 12 and 3 not in t for t in overlap)


def test_grammar_masks_hold_in_graph_decode_steps_and_leave_plain_rows_alone(qwen3_hd128_path):
    import re

    from cluster import GrammarSpec

    pytest.importorskip("xgrammar")
    prompts = random_prompts(6, 5, 60, seed=9)
    regex = r"[a-z]{4,12} (yes|no)"
    plain = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=30 + i) for i in range(6)]
    mixed = [
        SamplingParams(temperature=0.8, max_tokens=60, seed=30 + i, grammar=GrammarSpec("regex", regex)) if i % 2 else p
        for i, p in enumerate(plain)
    ]
    alone, _ = run(qwen3_hd128_path, prompts, plain, dtype="bfloat16", page_size=16)
    with checked_llm(
        qwen3_hd128_path, dtype="bfloat16", page_size=16, num_pages=KV_TOKENS // 16, max_running_reqs=16
    ) as llm:
        outs = llm.generate(prompts, mixed)
    assert [o.token_ids for o in outs[0::2]] == alone[0::2]
    for out in outs[1::2]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text)


def test_redrawing_a_large_batchs_few_special_rows_alone_equals_the_bucket_variant(qwen3_hd128_path, monkeypatch):
    """40 requests decode together, 8 of them with penalties and a bias, 4 under a grammar: the redraw
    of those rows alone (worker/sampling/resample.py) gives exactly the tokens that the bucket's variant graph
    gives, the constrained ones match their grammar, and the other 28 draw what they draw alone."""
    import re

    from cluster import GrammarSpec
    from worker.sampling import resample

    pytest.importorskip("xgrammar")
    n = 40
    prompts = random_prompts(n, 5, 60, seed=12)
    regex = r"[a-z]{4,12} (yes|no)"
    plain = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=40 + i) for i in range(n)]
    special = [
        SamplingParams(
            temperature=0.8,
            max_tokens=20,
            ignore_eos=True,
            seed=40 + i,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={5: 4.0},
        )
        if i % 5 == 0
        else SamplingParams(temperature=0.8, max_tokens=60, seed=40 + i, grammar=GrammarSpec("regex", regex))
        if i % 10 == 3
        else p
        for i, p in enumerate(plain)
    ]
    kw = dict(dtype="bfloat16", page_size=16, max_running_reqs=64)
    alone, _ = run(qwen3_hd128_path, prompts, plain, **kw)
    compact, _ = run(qwen3_hd128_path, prompts, special, **kw)
    monkeypatch.setattr(resample, "COMPACT_MIN_BATCH", 10**6)  # the bucket's variant graph for every step
    variant, _ = run(qwen3_hd128_path, prompts, special, **kw)
    assert compact == variant
    # the plain rows: what they draw with no special row beside them, but for bfloat16 near-ties (the
    # constrained rows sit out every other step, so the batch's size, and its GEMMs' rounding, differ)
    others = [i for i in range(n) if i % 5 and i % 10 != 3]
    assert agreement([alone[i] for i in others], [compact[i] for i in others]) >= 0.95
    assert [compact[i] for i in range(0, n, 5)] != [alone[i] for i in range(0, n, 5)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_hd128_path)
    for i in range(3, n, 10):
        assert re.fullmatch(regex, tok.decode(compact[i], skip_special_tokens=True)), tok.decode(compact[i])


def test_many_constrained_requests_at_once_keep_their_grammars_in_graph_and_overlap_steps(qwen3_hd128_path):
    """32 requests through 8 running slots (they join and leave at different steps, prompt chunks mixed
    with decodes, graph and redraw steps, the overlap loop): a tool-call-shaped JSON schema, a regex and
    none, sampled at temperature 1. No sampled token is ever one a grammar forbids (the engine would
    fail the request and generate would raise) and every constrained output that stops parses as its
    grammar says."""
    import json
    import re

    import jsonschema

    from cluster import GrammarSpec

    pytest.importorskip("xgrammar")
    call = {
        "type": "object",
        "properties": {
            "name": {"enum": ["quote_price", "get_weather"]},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
        "required": ["name", "arguments"],
    }
    regex = r"[a-z]{4,12} (yes|no)"
    n = 32
    prompts = random_prompts(n, 5, 300, seed=13)

    def params(i: int) -> SamplingParams:
        if i % 3 == 0:
            schema = GrammarSpec("json_schema", json.dumps(call))
            return SamplingParams(temperature=1.0, max_tokens=120, seed=i, grammar=schema)
        if i % 3 == 1:
            return SamplingParams(temperature=1.0, max_tokens=60, seed=i, grammar=GrammarSpec("regex", regex))
        return SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True)

    for overlap in (True, False):
        with checked_llm(
            qwen3_hd128_path,
            dtype="bfloat16",
            page_size=16,
            num_pages=KV_TOKENS // 16,
            max_running_reqs=8,
            max_extend_tokens=256,
            overlap=overlap,
        ) as llm:
            outs = llm.generate(prompts, [params(i) for i in range(n)])
        for i, out in enumerate(outs):
            if i % 3 == 0 and out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), call)
            elif i % 3 == 1:
                assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
