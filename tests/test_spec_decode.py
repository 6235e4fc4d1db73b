"""Speculative decoding (n-gram proposals, one verify step): greedy outputs equal those without it and
Hugging Face's, for every family, overlap on and off, page sizes 1 and 4, tp 2; seeded sampled outputs
equal those without it and keep the target's distribution; pages stay whole after rejections; the
requests with processors (penalties, biases, min-p, min_tokens) and grammars speculate too, their
outputs those without speculation."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_generate, hf_greedy
from helpers import checked_llm, client, encode_all, greedy, serving
from scipy.stats import chisquare
from tiny_checkpoints import build_cycling_checkpoint

from cluster import GrammarSpec, SamplingParams
from cluster.config import ConfigError, ReplicaConfig
from cluster.scheduler.ngram import propose_ngram
from worker.sampling.sampler import sample_unfiltered
from worker.sampling.verify import accepted, kept_counts, spec_rows

# text that repeats itself, so that prompt lookup finds proposals the model accepts (a random model
# soon repeats itself too)
REPEATING = [
    "the the the and and of of to to in in is is it it that that for for with with " * 2,
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells. " * 2,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
]
PROMPTS = PROMPT_TEXTS + REPEATING
# every step looks up (no back-off, and speculation on whatever it measures: the tests below count what
# it does, not whether it pays on this host; the gate has tests of its own, test_spec_gate.py)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_pause=0, speculative_adaptive=False)


def draft_of(path, k: int = 4) -> dict:
    """Speculation by a draft model identical to the target: every proposal is the target's."""
    return dict(
        speculative_method="draft", speculative_model=str(path), num_speculative_tokens=k, speculative_adaptive=False
    )


def spec_of(method: str, path) -> dict:
    return SPEC if method == "ngram" else draft_of(path)


def generate(path, prompts, params, **kw):
    """(token ids of each prompt's output, the scheduler's stats), the page allocator checked whole."""
    with checked_llm(path, **kw) as llm:
        ids = encode_all(llm, prompts) if isinstance(prompts[0], str) else prompts
        outs = llm.generate(ids, params)
        return [o.token_ids for o in outs], llm.stats(), ids


# -- the proposer ----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_recurring_suffix():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    # [1, 2, 3] recurs at the start (followed by 9 9); [2, 3] alone recurs later, but longer wins
    assert propose_ngram(tokens, 2, n_max=3) == [9, 9]
    assert propose_ngram(tokens, 2, n_max=2) == [4, 5]  # the latest [2, 3] with two tokens after it


def test_ngram_proposes_nothing_when_no_suffix_recurs_and_at_most_k():
    assert propose_ngram([5, 6, 7, 8], 3, n_max=4) == []
    assert propose_ngram([4, 5, 6, 7, 4], 2, n_max=2) == [5, 6]
    assert propose_ngram([4, 5, 4], 5, n_max=2) == [5, 4]  # the continuation runs to the end


def _ngram_by_windows(tokens: list[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """The rule written plainly: every window of n tokens that ends before the last one, compared with
    the suffix, from the longest n down."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        starts = [s for s in range(size - n) if tokens[s : s + n] == tokens[size - n :]]
        if starts:
            full = [s for s in starts if s + n + k <= size]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


def test_ngram_lookup_agrees_with_the_rule_on_random_sequences():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        size, vocab = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        tokens = rng.integers(0, vocab, size=size).tolist()
        k, n_max = int(rng.integers(1, 6)), int(rng.integers(1, 7))
        n_min = int(rng.integers(1, n_max + 1))
        assert propose_ngram(tokens, k, n_max, n_min) == _ngram_by_windows(tokens, k, n_max, n_min), (tokens, k, n_max)


# -- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value",
    [("speculative_method", "eagle9"), ("num_speculative_tokens", 0), ("speculative_ngram_max", 0)],
)
def test_a_bad_speculative_setting_is_refused_naming_it(key, value):
    with pytest.raises(ConfigError, match=key):
        ReplicaConfig().override(model="m", **{key: value})


def test_a_draft_model_is_required_with_draft_and_only_then(tmp_path, qwen3_path):
    with pytest.raises(ConfigError, match="speculative_model"):
        ReplicaConfig().override(model="m", speculative_method="draft").validate()
    with pytest.raises(ConfigError, match="speculative_model"):
        ReplicaConfig().override(model="m", speculative_model=str(qwen3_path)).validate()
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 17}))
    config = ReplicaConfig().override(
        model=str(qwen3_path), speculative_method="draft", speculative_model=str(tmp_path)
    )
    with pytest.raises(ConfigError, match="tokenizer"):
        config.check_against_model()


def test_speculation_is_off_by_default():
    assert ReplicaConfig().scheduler.speculative_method is None


# -- verification, as a rule ------------------------------------------------------------------------


def test_the_kept_samples_are_those_up_to_the_first_that_differs_from_its_proposal():
    # rows: 2 proposals, none, 3 proposals; the step's tokens: each row's input (-1) then its proposals
    spec_lens = np.array([2, 0, 3], dtype=np.int32)
    input_ids = np.array([-1, 11, 12, -1, -1, 31, 32, 33], dtype=np.int32)
    extend = spec_lens + 1
    rows = spec_rows(spec_lens, np.array([10, 20, 30], dtype=np.int32), np.cumsum(extend), input_ids)
    assert rows.drafts.tolist() == [11, 12, -1, -1, 31, 32, 33, -1]
    assert rows.sample_pos.tolist() == [8, 9, 10, 20, 27, 28, 29, 30]
    assert rows.last_idx.tolist() == list(range(8))
    # what each sample's penalties count beyond the output so far: the proposals before it in its row
    pairs = sorted(zip(rows.proposed_at.tolist(), rows.proposed_token.tolist()))
    assert pairs == [(1, 11), (2, 11), (2, 12), (5, 31), (6, 31), (6, 32), (7, 31), (7, 32), (7, 33)]
    sampled = torch.tensor([11, 99, 5, 7, 31, 32, 33, 8])  # row 0 rejects its second, row 2 keeps all
    kept = accepted(
        sampled,
        torch.from_numpy(rows.drafts),
        torch.from_numpy(rows.rows),
        torch.from_numpy(rows.row_start),
    )
    assert kept.tolist() == [2, 1, 4]
    assert kept_counts(sampled.tolist(), spec_lens.tolist(), input_ids) == [2, 1, 4]  # the host's count


def test_the_hosts_count_of_kept_samples_agrees_with_the_devices():
    rng = np.random.default_rng(3)
    for _ in range(500):
        spec_lens = rng.integers(0, 5, size=int(rng.integers(1, 6))).astype(np.int32)
        ext = spec_lens + 1
        input_ids = np.concatenate([[-1, *rng.integers(0, 3, size=s)] for s in spec_lens]).astype(np.int32)
        rows = spec_rows(spec_lens, 10 + np.cumsum(ext).astype(np.int32), np.cumsum(ext), input_ids)
        sampled = torch.from_numpy(rng.integers(0, 3, size=int(ext.sum())))
        on_device = [torch.from_numpy(a) for a in (rows.drafts, rows.rows, rows.row_start)]
        device = accepted(sampled, *on_device)
        assert kept_counts(sampled.tolist(), spec_lens.tolist(), input_ids) == device.tolist()


def test_verified_samples_keep_the_targets_distribution():
    """Rejection sampling against a one-hot proposal x: the kept first token must be distributed as p
    whatever x is, and x accepted with probability p(x). 40,000 draws of a 6-token distribution; the
    chi-square test at significance 1e-4 (a correct sampler fails it once in 10,000 runs)."""
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    n, proposal = 40_000, 1
    logits = p.log().expand(n, -1).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    draws = sample_unfiltered(logits, torch.ones(n), seeds, torch.full((n,), 5))
    # each draw is the first sample of a one-proposal row; the second sample is never needed here
    first = torch.stack([draws, torch.zeros(n, dtype=torch.int64)], 1).reshape(-1)
    drafts = torch.tensor([proposal, -1], dtype=torch.int32).repeat(n)
    rows = torch.arange(n).repeat_interleave(2)
    kept = accepted(first, drafts, rows, torch.arange(n) * 2)
    counts = torch.bincount(draws, minlength=len(p)).numpy()
    assert chisquare(counts, (p * n).numpy()).pvalue > 1e-4
    rate = (kept == 2).float().mean().item()  # accepted: the proposal and the next sample kept
    assert abs(rate - p[proposal].item()) < 4 * (p[proposal] * (1 - p[proposal]) / n).sqrt().item()


# -- the engine and scheduler --------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("overlap,page_size", [(True, 4), (False, 1)])
def test_greedy_with_speculation_equals_without_and_hf(model_paths, family, overlap, page_size):
    path = model_paths[family]
    kw = dict(overlap=overlap, page_size=page_size)
    on, stats, prompts = generate(path, PROMPTS, greedy(24), **kw, **SPEC)
    off, _, _ = generate(path, prompts, greedy(24), **kw)
    assert stats.spec_decode_num_accepted_tokens > 0  # proposals were kept: the check is not vacuous
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # and some rejected
    assert on == off == hf_greedy(path, prompts, 24)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def cycling(request, model_paths, tmp_path_factory):
    """A tiny model of that family whose output mostly follows short cycles of tokens (its layers' outputs
    shrunk, its LM head leaning to a permutation of the current token's embedding), so that n-gram lookup
    finds proposals it keeps whole at some steps and cuts short at others; and a draft for it, the same
    with its cycles' lean weaker, which mostly agrees with it."""
    src = model_paths[request.param]
    model = build_cycling_checkpoint(src, tmp_path_factory.mktemp(f"cycling-{request.param}"))[0]
    draft = build_cycling_checkpoint(src, tmp_path_factory.mktemp(f"cycling-draft-{request.param}"), lean=2.5)[0]
    return model, draft


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_pipelined_rows_launch_before_the_last_result_and_are_void_where_it_kept_fewer(cycling, method):
    """In the overlap loop a request's next verify row launches while its last is in flight, as if that one
    kept every proposal; where it kept fewer, the later row is dropped and its KV given back (the draft's
    too). Greedy and seeded outputs (logprobs too) equal those with the pipeline off and without
    speculation, and pages stay whole (checked_llm)."""
    path, draft = cycling
    spec = SPEC if method == "ngram" else dict(SPEC, speculative_method="draft", speculative_model=str(draft))
    params = [
        SamplingParams(max_tokens=64, temperature=0.8 if i % 2 else 0.0, seed=i, logprobs=1, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    runs = {}
    for name, kw in (("pipelined", spec), ("waiting", {**spec, "speculative_pipeline": False}), ("off", {})):
        with checked_llm(path, page_size=4, **kw) as llm:
            prompts = encode_all(llm, PROMPTS)
            outs = llm.generate(prompts, params)
            runs[name] = [o.token_ids for o in outs], [o.logprobs for o in outs], llm.scheduler.spec
    (ids, logprobs, spec), (waited, _, wait_spec), (off, off_logprobs, _) = (
        runs["pipelined"],
        runs["waiting"],
        runs["off"],
    )
    # rows ran ahead, most of them void (a tiny random model keeps few proposals), some not
    assert spec.num_pipelined_rows > spec.num_void_rows > 0
    assert spec.num_accepted_tokens > 0 and wait_spec.num_pipelined_rows == 0
    assert ids == waited == off
    for a, b in zip(logprobs, off_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_a_verify_step_of_every_speculating_request_runs_as_decode_rows(qwen3_path, monkeypatch):
    """Each sample of a verify step is a decode row of its own: the engine holds room for as many as
    speculative_max_batch requests' proposals and one more, beyond max_running_reqs (so that a full
    verify step replays a decode graph instead of running eagerly)."""
    from worker import engine as engine_module

    seen, convert = [], engine_module.verify_as_decode
    monkeypatch.setattr(
        engine_module,
        "verify_as_decode",
        lambda desc, *a: seen.append(convert(desc, *a) is not None) or convert(desc, *a),
    )
    with checked_llm(qwen3_path, page_size=4, max_running_reqs=4, **SPEC) as llm:
        assert llm.engine.table.token_pool.shape[0] == 4 * (SPEC["num_speculative_tokens"] + 1)
        prompts = encode_all(llm, REPEATING + PROMPT_TEXTS[:1])
        on = [o.token_ids for o in llm.generate(prompts, greedy(24, ignore_eos=True))]
    assert seen and all(seen)
    assert on == hf_greedy(qwen3_path, prompts, 24, ignore_eos=True)


def test_a_pipelined_request_waits_only_where_its_tail_is_unknown_or_its_last_bet_lost():
    """Its next proposals follow its tail (the proposals in flight and the token looked up after them):
    known, it does not wait for its result; after a plain row (unknown), it does, while speculating; after
    a verify step cut short, its next row (beside the void one) is no bet, but the one after it waits."""
    from cluster.scheduler.decode import DecodeManager

    spec, req = _backoff_speculator(0), _speculating_req([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    req.pipelines = True
    assert spec.propose([req]) == [[7, 8, 5]] and req.tail == [7, 8, 5, 6]  # "5 6" recurs
    assert not DecodeManager._waits(req, speculating=True)
    req.device_len += 4  # launched: its row adds 4 tokens if all are kept
    assert spec.propose([req]) == [[7, 8, 5]] and req.tail == [7, 8, 5, 6]  # after [..., 5, 6] + [7, 8, 5, 6]
    spec.accept(req, 3, 2, void=4)  # the first kept one proposal: the row after it is void
    assert req.tail == [] and spec.num_void_rows == 1
    assert not DecodeManager._waits(req, speculating=True)  # only a void row in flight: no bet to take
    assert spec.propose([req]) == [[7, 8, 5]]  # its next row, from what it kept
    # having lost the last bet, it waits for that row's result; one that keeps all ends the wait
    assert DecodeManager._waits(req, speculating=True)
    spec.accept(req, 3, 4)
    assert req.kept_all and not DecodeManager._waits(req, speculating=True)
    req.tail = None  # a plain row in flight
    assert DecodeManager._waits(req, speculating=True) and not DecodeManager._waits(req, speculating=False)


@pytest.mark.parametrize("overlap,page_size", [(True, 4), (False, 1)])
def test_a_draft_identical_to_the_model_has_every_greedy_proposal_accepted(qwen3_path, overlap, page_size, monkeypatch):
    """In the overlap loop the pipeline drafts each row on from the row in flight and its guess of that
    row's last sample, and keeps that draft KV where the guess was right: a draft identical to the model
    guesses right every time, so no row is void and every proposal, drafted ahead or not, is kept."""
    from cluster.scheduler.draft import DraftProposer

    caught_up: dict[int, list[int]] = {}  # per request, the tokens each catch-up of the draft computed
    extend = DraftProposer._extend

    def recording(self, rows):
        desc = extend(self, rows)
        for row, n in zip(rows, desc.extend_lens.tolist()):
            caught_up.setdefault(row.req.uid, []).append(n)
        return desc

    monkeypatch.setattr(DraftProposer, "_extend", recording)
    kw = dict(overlap=overlap, page_size=page_size)
    with checked_llm(qwen3_path, **kw, **draft_of(qwen3_path)) as llm:
        prompts = encode_all(llm, PROMPTS)
        on = [o.token_ids for o in llm.generate(prompts, greedy(24))]
        stats, spec = llm.stats(), llm.scheduler.spec
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert (spec.num_pipelined_rows > 0) == overlap and spec.num_void_rows == 0
    # after its prompt the draft sees the last proposal, whose KV it did not compute, and the last sample;
    # in the pipeline, where it drafts one token more, the last sample alone (its guess): the KV of what
    # it drafted, kept every time, is never computed again
    most = 1 if overlap else 2
    assert all(max(later, default=0) == most for _, *later in caught_up.values())
    assert on == hf_greedy(qwen3_path, prompts, 24)


def test_a_draft_identical_to_the_model_has_every_sampled_proposal_accepted(qwen3_path):
    """The draft draws each proposal with the request's own sampling settings and the noise the target's
    verify step draws with at that position: a draft identical to the model proposes the model's own
    draws, so at temperature 1 every proposal is kept (a greedy proposal would be kept only where it
    happened to be the draw), and the outputs are those without speculation."""
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_tokens=24, seed=7 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    on, stats, prompts = generate(qwen3_path, PROMPTS, params, page_size=4, **draft_of(qwen3_path))
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    off, _, _ = generate(qwen3_path, prompts, params, page_size=4)
    assert on == off


def test_the_memory_budget_leaves_the_draft_its_weights_and_as_many_pages(qwen3_path):
    """Without num_pages the model's cache is sized from the budget with the draft's cache counted beside
    it (as many pages): the draft, built after the model, fits. The draft's weights, counted from its
    config, are what the model loaded holds when the draft is the model itself."""
    from worker.draft_budget import draft_memory
    from worker.kv_cache import KVCachePool

    budget_gb = 0.004  # small enough that max_running_reqs' whole contexts do not cap the pages
    with checked_llm(qwen3_path, cpu_kv_cache_gb=budget_gb, page_size=4) as alone:
        pages_alone = alone.engine.num_pages
    with checked_llm(qwen3_path, cpu_kv_cache_gb=budget_gb, page_size=4, **draft_of(qwen3_path)) as llm:
        engine = llm.engine
        per_page = KVCachePool.bytes_per_page(
            engine.hf_config.num_hidden_layers, 4, engine.kv.num_kv_heads, engine.kv.head_dim, engine.kv_dtype
        )
        assert engine.num_pages == int(budget_gb * 2**30 // (2 * per_page))
        assert abs(engine.num_pages - pages_alone // 2) <= 1
        assert llm.scheduler.spec.draft.engine.num_pages == engine.num_pages
        draft = draft_memory(str(qwen3_path), engine.dtype, engine.kv_dtype, 4)
        assert draft.bytes_per_page == per_page
        loaded = {id(p): p for p in engine.model.parameters()}.values()
        assert draft.weight_bytes == sum(p.numel() * p.element_size() for p in loaded)
        assert llm.generate([[5, 6, 7, 5, 6]], greedy(8))[0].token_ids


def test_a_draft_transformers_cannot_build_is_counted_by_its_weights_files(qwen3_path, monkeypatch):
    from worker import draft_budget

    def cannot(config):
        raise ValueError("an architecture transformers does not know")

    monkeypatch.setattr(draft_budget.AutoModelForCausalLM, "from_config", cannot)
    files = sum(f.stat().st_size for f in qwen3_path.glob("*.safetensors"))
    assert files > 0
    assert draft_budget.draft_memory(str(qwen3_path), torch.float32, torch.float32, 4).weight_bytes == files


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_greedy_with_speculation_equals_hf(ray_cluster, qwen3_path, method):
    # grammars and penalties too: every rank masks and counts alike
    constrained = [greedy(32, grammar=g) for g in GRAMMARS] + [greedy(24, ignore_eos=True, repetition_penalty=1.3)]
    with checked_llm(qwen3_path, tp_size=2, page_size=4, **spec_of(method, qwen3_path)) as llm:
        prompts = encode_all(llm, PROMPTS)
        on = [o.token_ids for o in llm.generate(prompts, greedy(16))]
        assert llm.stats().spec_decode_num_accepted_tokens > 0
        on_constrained = [o.token_ids for o in llm.generate(prompts[-1:] * 4, constrained)]
    assert on == hf_greedy(qwen3_path, prompts, 16)
    with checked_llm(qwen3_path, page_size=4) as llm:
        assert on_constrained == [o.token_ids for o in llm.generate(prompts[-1:] * 4, constrained)]


@pytest.mark.parametrize("method,overlap", [("ngram", True), ("ngram", False), ("draft", True)])
def test_seeded_sampling_with_speculation_equals_without_logprobs_too(qwen3_path, method, overlap):
    """The verify step keeps a token only where it is the target's own draw at that position, so a
    seeded request produces the same tokens (and logprobs) with speculation as without."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=24, seed=i, logprobs=2, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    kw = dict(overlap=overlap, page_size=4)
    with checked_llm(qwen3_path, **kw, **spec_of(method, qwen3_path)) as llm:
        prompts = encode_all(llm, PROMPTS)
        on = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        stats = llm.stats()
    with checked_llm(qwen3_path, **kw) as llm:
        off = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert stats.spec_decode_num_accepted_tokens > 0
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    for (_, a), (_, b) in zip(on, off):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("overlap", [True, False])
def test_speculation_turns_off_and_on_as_the_batch_crosses_its_bound(qwen3_path, overlap):
    """At most 3 requests run and at most 2 speculate: as requests end and others are admitted, steps
    go from verifying to plain decoding while verify steps are in flight, and back."""
    texts = REPEATING * 4
    params = [greedy(8 + 8 * (i % 4), ignore_eos=True) for i in range(len(texts))]
    kw = dict(overlap=overlap, page_size=4, max_running_reqs=3, speculative_max_batch=2)
    with checked_llm(qwen3_path, **kw, **SPEC) as llm:
        prompts = encode_all(llm, texts)
        on = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert on == [hf_greedy(qwen3_path, [p], x.max_tokens, ignore_eos=True)[0] for p, x in zip(prompts, params)]


def _backoff_speculator(max_pause: int):
    from types import SimpleNamespace

    from cluster.config import SchedulerConfig
    from cluster.scheduler.spec_decode import Speculator

    config = SchedulerConfig(speculative_method="ngram", num_speculative_tokens=3, speculative_max_pause=max_pause)
    cache = SimpleNamespace(available=1000, extra_pages=lambda req, n: 0, trim=lambda req, n: None)
    return Speculator(config, cache)


def _speculating_req(ids: list[int]):
    from cluster.scheduler.req import Req

    req = Req(uid=1, input_ids=list(ids), params=SamplingParams(max_tokens=1000), max_device_len=2000, seed=0)
    req.speculates = True
    return req


def test_a_request_whose_proposals_do_not_pay_backs_off_into_the_overlap_loop():
    """Lookups that find nothing pause a request's speculation for 2, 4, 8 ... steps up to the bound,
    during which it does not wait for its own results; a kept proposal ends the back-off, a step whose
    proposals were all rejected starts it; a bound of 0 never pauses."""
    from cluster.scheduler.decode import DecodeManager

    spec, req = _backoff_speculator(8), _speculating_req([1, 2, 3, 4, 5])
    waited = []
    for step in range(40):
        if DecodeManager._waits(req, speculating=True):
            waited.append(step)
        assert spec.propose([req]) is None
        req.input_ids.append(100 + step)  # text that never repeats
    assert waited == [0, 3, 8, 17, 26, 35]  # pauses of 2, 4, 8, then 8 (the bound)
    req.spec_pause = 0
    req.input_ids += [7, 8, 9, 7, 8]  # "7 8" recurs: "9 7 8" followed it
    assert spec.propose([req]) == [[9, 7, 8]] and req.spec_misses == 6  # one a wait above
    spec.accept(req, 3, 2)  # one proposal kept
    assert (req.spec_misses, req.spec_pause) == (0, 0) and DecodeManager._waits(req, speculating=True)
    spec.accept(req, 3, 1)  # all rejected
    assert (req.spec_misses, req.spec_pause) == (1, 2) and not DecodeManager._waits(req, speculating=True)
    never, plain = _backoff_speculator(0), _speculating_req(range(10, 20))
    for _ in range(5):
        assert never.propose([plain]) is None and plain.spec_pause == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_outputs_with_speculation_backing_off_equal_those_without(qwen3_path, llama_path, method, monkeypatch):
    """The default back-off (sampled rows reject most n-gram proposals, and a draft of other weights, a
    random llama, rarely proposes the model's tokens): seeded and greedy requests side by side return what
    they do without speculation; requests backed off, and speculation still verified some."""
    from cluster.scheduler.spec_decode import Speculator

    missed, miss = [], Speculator._missed
    monkeypatch.setattr(Speculator, "_missed", lambda self, req: missed.append(req.uid) or miss(self, req))
    params = [
        SamplingParams(max_tokens=24, temperature=1.0 if i % 2 else 0.0, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    spec = dict(spec_of(method, qwen3_path))
    if method == "draft":
        spec["speculative_model"] = str(llama_path)
    spec.pop("speculative_max_pause", None)
    on, stats, prompts = generate(qwen3_path, PROMPTS, params, page_size=4, **spec)
    off, _, _ = generate(qwen3_path, prompts, params, page_size=4)
    assert on == off and stats.spec_decode_num_draft_tokens > 0 and missed


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_pages_stay_whole_after_rejections_and_preemptions(llama_path, method):
    # too few pages for every request's growth: speculating requests are preempted and recomputed,
    # and the rejected proposals' pages are given back each step (checked_llm checks the allocator)
    kw = dict(page_size=4, num_pages=80, decode_reserve_tokens=1)
    with checked_llm(llama_path, **kw, **spec_of(method, llama_path)) as llm:
        prompts = encode_all(llm, PROMPTS)
        on = [o.token_ids for o in llm.generate(prompts, greedy(24, ignore_eos=True))]
        stats = llm.stats()
        if method == "draft":  # the draft's own pages are back too
            draft = llm.scheduler.spec.draft
            assert draft.allocator.num_free == draft.allocator.num_pages and not draft.seqs
    assert stats.preempted > 0 and stats.spec_decode_num_accepted_tokens > 0
    if method == "ngram":
        assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # some rejected
    assert on == hf_greedy(llama_path, prompts, 24, ignore_eos=True)


def test_max_tokens_and_stop_tokens_end_a_request_inside_a_verify_step(qwen3_path):
    plain, _, prompts = generate(qwen3_path, REPEATING, greedy(30, ignore_eos=True), page_size=4)
    # stop at the 12th token of each output: a verify step that samples past it must drop the rest
    params = [greedy(30, stop_token_ids=[out[11]], ignore_eos=True) for out in plain]
    stopped, _, _ = generate(qwen3_path, prompts, params, page_size=4, **SPEC)
    assert stopped == [out[: out.index(out[11]) + 1] for out in plain]
    for n in (1, 5, 7):
        short, _, _ = generate(qwen3_path, prompts, greedy(n, ignore_eos=True), page_size=4, **SPEC)
        assert short == [out[:n] for out in plain]


def test_requests_with_processors_speculate_beside_plain_ones_and_equal_hf(qwen3_path):
    """Penalties, biases and min_tokens in a batch where plain requests speculate too; every output is
    Hugging Face's."""
    plain, _, prompts = generate(qwen3_path, REPEATING, greedy(20, ignore_eos=True), page_size=4)
    bias = {plain[0][1]: -4.0, 7: 3.5}
    stop = plain[0][2]  # emitted early by plain greedy: holding it back changes the argmax
    params = [
        greedy(20, ignore_eos=True, repetition_penalty=1.5),
        greedy(20, ignore_eos=True, logit_bias=bias),
        greedy(20, stop_token_ids=[stop], min_tokens=8),
        greedy(20, ignore_eos=True),
    ]
    with checked_llm(qwen3_path, page_size=4, **SPEC) as llm:
        eos = sorted(llm.scheduler.eos_ids)
        outs = llm.generate(prompts * len(params), [p for p in params for _ in prompts])
        stats = llm.stats()
    on = [o.token_ids for o in outs]
    n = len(prompts)
    assert stats.spec_decode_num_accepted_tokens > 0
    assert on[:n] == hf_generate(qwen3_path, prompts, 20, repetition_penalty=1.5, eos_token_id=[])
    assert on[n : 2 * n] == hf_generate(
        qwen3_path, prompts, 20, eos_token_id=[], sequence_bias={(t,): b for t, b in bias.items()}
    )
    assert on[2 * n : 3 * n] == hf_generate(qwen3_path, prompts, 20, min_new_tokens=8, eos_token_id=eos + [stop])
    assert on[3 * n :] == plain


def test_biased_min_p_and_min_tokens_requests_speculate_and_equal_their_outputs_without(qwen3_path):
    """A logit bias and min-p are the same at every position, and no verify step crosses a request's
    min_tokens: their requests speculate, and each verify sample applies them as a decode step would."""
    plain, _, prompts = generate(qwen3_path, REPEATING, greedy(20, ignore_eos=True), page_size=4)
    bias = {plain[0][1]: -4.0, 7: 3.5}
    params = [
        greedy(20, ignore_eos=True, logit_bias=bias),
        greedy(20, stop_token_ids=sorted({t for out in plain for t in out[3:9]}), min_tokens=9),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, min_p=0.2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, min_p=0.1, logit_bias=bias, ignore_eos=True),
    ]
    ids = [p for p in prompts for _ in params]
    off, _, _ = generate(qwen3_path, ids, params * len(prompts), page_size=4)
    on, stats, _ = generate(qwen3_path, ids, params * len(prompts), page_size=4, **SPEC)
    assert on == off
    assert stats.spec_decode_num_accepted_tokens > 0


def test_penalized_requests_speculate_and_each_sample_counts_the_proposals_before_it(qwen3_path):
    """A verify sample's penalties count the output so far and the proposals before it in its row, and
    only the kept samples are counted afterwards: penalized outputs, greedy and seeded, are those without
    speculation (and Hugging Face's repetition penalty)."""
    params = [
        greedy(24, ignore_eos=True, repetition_penalty=1.3),
        greedy(24, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=12, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
    ]
    with checked_llm(qwen3_path, page_size=4) as llm:
        prompts = encode_all(llm, REPEATING)
        ids = [p for p in prompts for _ in params]
        off = [o.token_ids for o in llm.generate(ids, params * len(prompts))]
    for method in ("ngram", "draft"):
        on, stats, _ = generate(qwen3_path, ids, params * len(prompts), page_size=4, **spec_of(method, qwen3_path))
        assert on == off, method
        assert stats.spec_decode_num_accepted_tokens > 0, method
    n = len(params)
    assert off[::n] == hf_generate(qwen3_path, prompts, 24, repetition_penalty=1.3, eos_token_id=[])


def test_no_verify_step_crosses_a_requests_min_tokens():
    """A verify row's stop-token ban is the row's: while a request is short of min_tokens, its
    proposals stop where their samples would reach the bound."""
    from types import SimpleNamespace

    from cluster.config import SchedulerConfig
    from cluster.scheduler.req import Req
    from cluster.scheduler.spec_decode import Speculator

    cache = SimpleNamespace(available=1000, extra_pages=lambda req, n: 0)
    spec = Speculator(SchedulerConfig(speculative_method="ngram", num_speculative_tokens=4), cache)
    req = Req(1, list(range(10)), SamplingParams(max_tokens=40, min_tokens=5), max_device_len=50, seed=0)
    req.speculates = True
    caps = []
    for _ in range(8):
        caps.append(spec._caps([req])[0])
        req.input_ids.append(0)
    # output tokens 0..7 so far: samples reach output token number out + cap, which stays below 5 or
    # starts at 5 or later
    assert caps == [4, 3, 2, 1, 0, 4, 4, 4]


def test_n_choices_with_speculation_equal_those_without(qwen3_path):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, n=3, ignore_eos=True)
    with checked_llm(qwen3_path, page_size=4, **SPEC) as llm:
        prompts = encode_all(llm, REPEATING)
        on = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    with checked_llm(qwen3_path, page_size=4) as llm:
        off = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert on == off and all(len(choices) == 3 for choices in on)


def test_grammar_requests_speculate_and_their_outputs_match_the_grammar(qwen3_path):
    grammar = GrammarSpec("regex", "(ab){6}")
    with checked_llm(qwen3_path, page_size=4, **SPEC) as llm:
        prompts = encode_all(llm, REPEATING)
        outs = llm.generate(prompts, [greedy(30, grammar=grammar)] * 3)
        stats = llm.stats()
        plain = llm.generate(prompts, greedy(20))
    assert [(o.text, o.finish_reason) for o in outs] == [("ab" * 6, "stop")] * 3
    assert stats.spec_decode_num_accepted_tokens > 0  # the constrained requests alone speculated
    assert [o.token_ids for o in plain] == hf_greedy(qwen3_path, prompts, 20)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "ab"]}}},
    "required": ["name", "tags"],
}
GRAMMARS = [
    GrammarSpec("regex", "((ab|ba) ){4,12}"),
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("regex", "[a-e ]{10,40}"),
]


@pytest.mark.parametrize("method,overlap", [("ngram", True), ("ngram", False), ("draft", True)])
def test_constrained_outputs_with_speculation_equal_those_without_greedy_and_seeded(qwen3_path, method, overlap):
    """Each sample of a constrained verify row is masked by its grammar's state after the proposals
    before it, and proposals stop where the grammar rejects one: the kept tokens are those that
    decoding without speculation draws, under the grammar."""
    params = [greedy(48, grammar=g) for g in GRAMMARS] + [
        SamplingParams(temperature=1.0, seed=40 + i, max_tokens=48, grammar=g) for i, g in enumerate(GRAMMARS)
    ]
    kw = dict(page_size=4, overlap=overlap)
    with checked_llm(qwen3_path, **kw) as llm:
        prompts = encode_all(llm, REPEATING[:2])
        ids = [p for p in prompts for _ in params]
        off = llm.generate(ids, params * len(prompts))
    with checked_llm(qwen3_path, **kw, **spec_of(method, qwen3_path)) as llm:
        on = llm.generate(ids, params * len(prompts))
        stats = llm.stats()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert stats.spec_decode_num_accepted_tokens > 0
    for out, p in zip(on, params * len(prompts)):
        if p.grammar.kind == "json_schema" and out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "tags"}


def test_verify_masks_are_the_grammars_after_each_proposal_and_leave_the_matcher_where_it_was(qwen3_path):
    from cluster.model_info import load_tokenizer
    from cluster.scheduler.grammars import Grammars, accepted_prefix

    tokenizer = load_tokenizer(str(qwen3_path))
    vocab = json.loads((qwen3_path / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    compiled = grammars.compile(GrammarSpec("regex", "(ab|cd){2}x")).result()
    m = grammars.matcher(compiled)
    assert m.accept_token(tokenizer.convert_tokens_to_ids("a"))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ["b", "c", "d", "x", "c"]]
    before = grammars.masks([m])
    # cut at the first token rejected, and before the stop token that would end the output
    assert accepted_prefix(m, ids) == 4 and accepted_prefix(m, ids[:1] + ids[3:]) == 1
    assert accepted_prefix(m, [*ids[:4], tokenizer.eos_token_id]) == 4
    assert np.array_equal(grammars.masks([m]), before)
    masks = grammars.verify_masks([(m, ids[:3]), (grammars.matcher(compiled), [])])
    assert np.array_equal(grammars.masks([m]), before)
    for j in range(4):
        fresh = grammars.matcher(compiled)
        assert all(fresh.accept_token(t) for t in [tokenizer.convert_tokens_to_ids("a"), *ids[:j]])
        assert np.array_equal(masks[j], grammars.masks([fresh])[0]), j
    assert np.array_equal(masks[4], grammars.masks([grammars.matcher(compiled)])[0])
    grammars.shutdown()


def test_the_server_streams_stop_strings_and_logprobs_and_exports_spec_decode_counters(ray_cluster, qwen3_path):
    prompt = REPEATING[2]  # its greedy output repeats itself: proposals are accepted
    with serving(qwen3_path, **SPEC) as srv:
        api = client(srv)
        full = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
        text = full.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
        chunks = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert streamed == text
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert len(full.choices[0].logprobs.token_logprobs) == full.usage.completion_tokens == 24
    counters = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if "spec_decode" in line and not line.startswith("#")
    }
    assert (
        counters["raylm:spec_decode_num_draft_tokens_total"]
        >= counters["raylm:spec_decode_num_accepted_tokens_total"]
        > 0
    ), json.dumps(counters)


# -- on the GPU (bench/gpu.sh tests) ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_on_gpu_greedy_with_speculation_equals_hf_in_float32(qwen3_path, method):
    from worker.kernels import Kernels

    kw = dict(kernels=Kernels(attention="torch"), dtype="float32", num_pages=16384, page_size=4)
    with checked_llm(qwen3_path, **kw, **spec_of(method, qwen3_path)) as llm:
        assert llm.engine.device.type == "cuda"
        prompts = encode_all(llm, PROMPTS)
        outs = [o.token_ids for o in llm.generate(prompts, greedy(24))]
        stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert outs == hf_greedy(qwen3_path, prompts, 24)


@pytest.mark.gpu
def test_on_gpu_a_draft_identical_to_the_model_verifies_with_flashinfer_in_bfloat16(tmp_path):
    """FlashInfer's decode kernels verify (one row a proposed position; its prefill kernels where the
    samples outnumber the rows) and draft, in batches of other sizes: in bfloat16 they round differently,
    so near-ties may part; nearly every proposal must still be accepted."""
    from tiny_checkpoints import build_qwen3_hd128, random_prompts

    from worker.attention.flashinfer_backend import FlashInferBackend

    path = build_qwen3_hd128(tmp_path / "qwen3_hd128")
    kw = dict(dtype="bfloat16", num_pages=16384, max_running_reqs=16, **draft_of(path))
    with checked_llm(path, **kw) as llm:
        assert isinstance(llm.engine.attn, FlashInferBackend)
        outs = llm.generate(random_prompts(12, 5, 60), greedy(40, ignore_eos=True))
        stats = llm.stats()
    assert all(len(o.token_ids) == 40 for o in outs)
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0
