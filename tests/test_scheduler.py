"""The scheduler over a real engine: both loops against Hugging Face, the prefix cache, chunked prefill,
memory pressure and preemption, a failing step, and the four overlap bugs, each pinned by a test that
fails if the bug comes back. Scheduling decisions without a model are in test_scheduling.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, fail_first_launch, greedy

from cluster import InvalidRequestError, SamplingParams
from cluster.messages import AddRequest, TokenDelta
from worker.kernels import Kernels


def capture(llm) -> list[TokenDelta]:
    """Records every delta the scheduler sends, in order, as a streaming consumer would see them."""
    seen: list[TokenDelta] = []
    forward = llm.scheduler.on_output

    def on_output(deltas):
        seen.extend(deltas)
        forward(deltas)

    llm.scheduler.on_output = on_output
    return seen


@pytest.mark.parametrize(
    "cache_type,chunk,page_size", [("radix", 8192, 1), ("naive", 5, 1), ("radix", 7, 4), ("radix", 8192, 16)]
)
def test_overlap_equals_normal_equals_hf(qwen3_path, cache_type, chunk, page_size):
    results = {}
    for overlap in (True, False):
        with checked_llm(
            qwen3_path,
            cache_type=cache_type,
            max_extend_tokens=chunk,
            page_size=page_size,
            num_pages=2048 // page_size,
            overlap=overlap,
        ) as llm:
            prompts = encode_all(llm, PROMPT_TEXTS)
            # twice: the second round runs on a warm prefix cache
            results[overlap] = [o.token_ids for o in llm.generate(prompts, greedy(12))]
            assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == results[overlap]
    assert results[True] == results[False] == hf_greedy(qwen3_path, prompts, 12)


def test_finished_flag_comes_only_with_the_last_token(qwen3_path):
    with checked_llm(qwen3_path, overlap=True) as llm:
        seen = capture(llm)
        llm.generate(PROMPT_TEXTS[:2], greedy(3, ignore_eos=True))
    for uid in {d.uid for d in seen}:
        flags = [d.finished for d in seen if d.uid == uid]
        assert flags == [False, False, True]


def test_stale_result_after_eos_is_dropped(qwen3_path):
    with checked_llm(qwen3_path, overlap=True) as llm:
        prompt = llm.tokenizer(PROMPT_TEXTS[3]).input_ids
        free = llm.generate([prompt], greedy(8, ignore_eos=True))[0].token_ids
        third = free[2]
        llm.scheduler.eos_ids = frozenset({third})
        seen = capture(llm)
        out = llm.generate([prompt], greedy(8))[0]
    stop = free.index(third) + 1
    assert out.token_ids == free[:stop]
    assert [d.token for d in seen] == free[:stop]  # nothing after the message that said finished
    assert [d.finished for d in seen] == [False] * (stop - 1) + [True]


def test_request_slot_is_never_handed_out_while_an_in_flight_batch_uses_it(qwen3_path):
    # One slot, and every request ends at its first token (every id is an EOS id): under overlap each
    # request's decode step is already in flight when its EOS is handled, so a slot returned at once
    # would be handed to the next request while that batch still writes into its row
    # (SlotTable.allocate raises SlotReuseError).
    with checked_llm(qwen3_path, overlap=True, max_running_reqs=1) as llm:
        llm.scheduler.eos_ids = frozenset(range(llm.engine.hf_config.vocab_size))
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        outs = llm.generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == [r[:1] for r in hf_greedy(qwen3_path, prompts, 1)]


def test_abort_while_prefill_is_in_flight_yields_no_output(qwen3_path):
    with checked_llm(qwen3_path, overlap=True, cache_type="radix") as llm:
        sched = llm.scheduler
        seen = capture(llm)
        launch = sched.executor.launch
        launches = []

        def launch_then_abort(desc):
            out = launch(desc)
            launches.append(desc.is_prefill)
            if len(launches) == 1:
                sched.abort(0)  # arrives while the prefill of request 0 is in flight
            return out

        sched.executor.launch = launch_then_abort
        out = llm.generate([llm.tokenizer(PROMPT_TEXTS[5]).input_ids], greedy(8))[0]
        assert launches[0] is True
        assert seen == [] and out.token_ids == []
        assert sched.req_slots.available == sched.req_slots.num_slots
        sched.executor.launch = launch
        # the replica keeps serving, and what it cached for the aborted prompt is sound
        prompt = llm.tokenizer(PROMPT_TEXTS[5]).input_ids
        again = llm.generate([prompt], greedy(8))[0].token_ids
    assert again == hf_greedy(qwen3_path, [prompt], 8)[0]


def test_radix_cache_computes_far_fewer_prefill_tokens_on_shared_prefixes(qwen3_path):
    prefix = PROMPT_TEXTS[-1] + " " + PROMPT_TEXTS[-2]
    suffixes = [" one", " two", " three", " four", " five", " six"]
    counts, outputs = {}, {}
    for cache_type in ("naive", "radix"):
        with checked_llm(qwen3_path, cache_type=cache_type, page_size=4, num_pages=512) as llm:
            prompts = encode_all(llm, [prefix + s for s in suffixes])
            first = llm.generate(prompts[:1], greedy(6))
            rest = llm.generate(prompts[1:], greedy(6))
            counts[cache_type] = llm.scheduler.snapshot().prefill_tokens
            outputs[cache_type] = [o.token_ids for o in first + rest]
    total = sum(len(p) for p in prompts)
    assert counts["naive"] == total
    assert counts["radix"] < total * 0.4
    assert outputs["radix"] == outputs["naive"] == hf_greedy(qwen3_path, prompts, 6)


def test_requests_beyond_capacity_wait_and_all_complete_without_over_commit(qwen3_path):
    # 80 pages of 4 tokens: room for a few of these requests at a time, not all
    with checked_llm(qwen3_path, page_size=4, num_pages=80, overlap=True) as llm:
        cache = llm.scheduler.cache
        launch = llm.scheduler.executor.launch
        peak = []

        def checked_launch(desc):
            assert cache.reserved <= cache.allocator.num_free + cache.prefix_cache.num_evictable
            peak.append(len(desc.slots))
            return launch(desc)

        llm.scheduler.executor.launch = checked_launch
        prompts = encode_all(llm, PROMPT_TEXTS)
        outs = llm.generate(prompts, greedy(10))
        # the radix cache is full of the first round's prompts; new prompts must evict them
        more = encode_all(llm, [t[::-1] for t in PROMPT_TEXTS])
        outs_more = llm.generate(more, greedy(10))
        assert max(peak) < len(prompts)
    assert [o.token_ids for o in outs] == hf_greedy(qwen3_path, prompts, 10)
    assert [o.token_ids for o in outs_more] == hf_greedy(qwen3_path, more, 10)


def test_a_request_that_can_never_fit_is_rejected(qwen3_path):
    with checked_llm(qwen3_path, page_size=4, num_pages=8) as llm:
        with pytest.raises(InvalidRequestError, match="lower max_tokens"):
            llm.generate([[3] * 20], greedy(40))


@pytest.mark.parametrize(
    "overlap,reserve",
    [(True, 1024), (False, 1024), (True, 1), (False, 1)],
    ids=["overlap", "normal", "overlap-preempting", "normal-preempting"],
)
def test_random_workload_with_aborts_matches_hf(qwen3_path, overlap, reserve):
    rng = random.Random(1234 + overlap)
    with checked_llm(
        qwen3_path,
        page_size=2,
        num_pages=160,
        max_extend_tokens=48,
        max_running_reqs=8,
        overlap=overlap,
        decode_reserve_tokens=reserve,
    ) as llm:
        sched = llm.scheduler
        got: dict[int, list[int]] = {}
        done: set[int] = set()

        def collect(deltas):
            for d in deltas:
                got.setdefault(d.uid, []).append(d.token)
                if d.finished:
                    done.add(d.uid)

        sched.on_output = collect
        vocab = llm.engine.hf_config.vocab_size
        prompts = {uid: [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for uid in range(40)}
        # the preempting runs grow further than their 1-token reservations, into too few pages for all
        max_tokens = {uid: rng.randint(1, 16) if reserve > 1 else rng.randint(8, 48) for uid in prompts}
        for uid, ids in prompts.items():
            sched.submit(AddRequest(uid, ids, greedy(max_tokens[uid])))
        aborted = set(rng.sample(sorted(prompts), 10))
        steps = 0
        while sched.has_work:
            sched.step()
            steps += 1
            for uid in [u for u in aborted if rng.random() < 0.1]:
                sched.abort(uid)
        sched.check_integrity()
        assert (sched.snapshot().preempted > 0) == (reserve == 1)
    finished = set(prompts) - aborted
    assert finished <= done
    for uid in prompts:
        ref = hf_greedy(qwen3_path, [prompts[uid]], max_tokens[uid])[0]
        if uid in finished:
            assert got[uid] == ref, uid
        else:
            assert got.get(uid, []) == ref[: len(got.get(uid, []))], uid


def _record_preemptions(llm) -> list[tuple[int, ...]]:
    """The prompts of the requests the scheduler preempted, once per preemption, as they end."""
    prompts: list[tuple[int, ...]] = []

    def recording(req, reason):
        prompts.extend([tuple(req.input_ids[: req.prompt_len])] * req.num_preempted)

    llm.scheduler.on_finish = recording
    return prompts


@pytest.mark.parametrize("overlap,cache_type", [(True, "radix"), (False, "radix"), (True, "naive")])
def test_requests_that_outgrow_their_reservation_are_preempted_and_still_match_hf(qwen3_path, overlap, cache_type):
    # 12 prompts that grow by 40 tokens each, 4 tokens reserved at admission, 64 pages of 4 tokens: they
    # are all admitted, then run out of pages while decoding
    with checked_llm(
        qwen3_path, page_size=4, num_pages=64, decode_reserve_tokens=4, overlap=overlap, cache_type=cache_type
    ) as llm:
        preempted = _record_preemptions(llm)
        prompts = encode_all(llm, PROMPT_TEXTS)
        outs = llm.generate(prompts, greedy(40, ignore_eos=True))
        assert llm.stats().preempted == len(preempted) > 0
    assert [o.token_ids for o in outs] == hf_greedy(qwen3_path, prompts, 40, ignore_eos=True)


def test_seeded_sampling_is_the_same_with_and_without_preemption(qwen3_path):
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=100 + i)
        for i in range(len(PROMPT_TEXTS))
    ]
    results = {}
    for num_pages in (2048, 96):
        with checked_llm(qwen3_path, page_size=4, num_pages=num_pages, decode_reserve_tokens=2) as llm:
            preempted = _record_preemptions(llm)
            results[num_pages] = [o.token_ids for o in llm.generate(encode_all(llm, PROMPT_TEXTS), params)]
            assert bool(preempted) == (num_pages == 96)
    assert results[2048] == results[96]


def test_prompt_logprobs_survive_a_preemption_while_the_last_prompt_chunk_is_in_flight(qwen3_path):
    """Under overlap a request decodes (and may be preempted) as soon as its last prompt chunk launches;
    that chunk's scores are then dropped with the step's result, and the recompute scores the whole
    prompt again: every position's logprob comes back, as without the preemption."""
    prompts = [[193, 65, 99, 23, 44, 71, 127], [108, 206, 329, 16, 236, 250, 233, 200, 254, 294]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, prompt_logprobs=1) for m in (7, 10)]
    with checked_llm(qwen3_path) as llm:
        want = llm.generate(prompts, params)
    tight = dict(page_size=4, num_pages=5, decode_reserve_tokens=1, max_extend_tokens=6, overlap=True)
    with checked_llm(qwen3_path, **tight) as llm:
        got = llm.generate(prompts, params)
        assert llm.stats().preempted > 0
    for w, g, prompt in zip(want, got, prompts):
        assert len(g.prompt_logprobs) == len(prompt) - 1 and g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [e for e, _ in g.prompt_logprobs] == pytest.approx([e for e, _ in w.prompt_logprobs], abs=1e-4)


def test_two_requests_admitted_into_each_others_last_page_do_not_preempt_each_other_forever(qwen3_path):
    """With no decode reserve, a request whose prompt ends in a step needs a page beyond its reservation
    for its first decode: a request admitted beside it leaves that page free. Else each preempted the
    other with its first token in flight, in turn, and neither ever got a token."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 360) for _ in range(n)] for n in (26, 21)]
    params = [greedy(24, ignore_eos=True), greedy(5, ignore_eos=True)]
    tight = dict(page_size=1, num_pages=51, decode_reserve_tokens=0, max_extend_tokens=9, cache_type="naive")
    with checked_llm(qwen3_path, max_seq_len=64, overlap=True, **tight) as llm:
        sched, launches = llm.scheduler, []
        launch = sched.executor.launch

        def bounded(desc):  # a livelock ends the test instead of hanging it: every request aborted
            launches.append(desc.is_prefill)
            if len(launches) == 500:
                for uid in list(sched.reqs):
                    sched.abort(uid)
            return launch(desc)

        sched.executor.launch = bounded
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        assert len(launches) < 500
    assert outs == [hf_greedy(qwen3_path, [p], x.max_tokens, ignore_eos=True)[0] for p, x in zip(prompts, params)]


def test_a_request_within_its_reservation_is_never_preempted(qwen3_path):
    with checked_llm(qwen3_path, page_size=4, num_pages=64, decode_reserve_tokens=8) as llm:
        preempted = _record_preemptions(llm)
        prompts = encode_all(llm, PROMPT_TEXTS)
        # even-numbered requests fit their reservation (8 new tokens); odd ones grow to 40
        params = [greedy(8 if i % 2 == 0 else 40, ignore_eos=True) for i in range(len(prompts))]
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert preempted and not {tuple(p) for p in prompts[0::2]} & set(preempted)
    assert outs[0::2] == hf_greedy(qwen3_path, prompts[0::2], 8, ignore_eos=True)
    assert outs[1::2] == hf_greedy(qwen3_path, prompts[1::2], 40, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_engine_failure_right_after_a_preemption_loses_no_token(qwen3_path, overlap):
    """The failed batch's requests end with an error; the request preempted for that batch is not in
    it, and must still produce every token once and finish."""
    with checked_llm(qwen3_path, page_size=4, num_pages=64, decode_reserve_tokens=4, overlap=overlap) as llm:
        sched = llm.scheduler
        launch, failed = sched.executor.launch, []

        def fail_after_first_preemption(desc):
            if sched.snapshot().preempted and not failed:
                failed.append(desc)
                raise RuntimeError("a transient engine error")
            return launch(desc)

        sched.executor.launch = fail_after_first_preemption
        got: dict[int, list[int]] = {}
        ends: dict[int, str] = {}

        def collect(deltas):
            for d in deltas:
                if d.token is not None:
                    got.setdefault(d.uid, []).append(d.token)
                if d.finished:
                    ends[d.uid] = d.finish_reason

        sched.on_output = collect
        prompts = encode_all(llm, PROMPT_TEXTS)
        for uid, ids in enumerate(prompts):
            sched.submit(AddRequest(uid, ids, greedy(40, ignore_eos=True)))
        for _ in range(5000):
            if not sched.has_work:
                break
            sched.step()
        assert not sched.has_work, "requests left that can never finish"
    assert failed and set(ends) == set(range(len(prompts)))
    refs = hf_greedy(qwen3_path, prompts, 40, ignore_eos=True)
    for uid in range(len(prompts)):
        if ends[uid] != "error":
            assert got[uid] == refs[uid], uid


def test_an_exception_inside_one_step_fails_that_batch_not_the_engine(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        sched = llm.scheduler
        collect = sched.on_output
        fail_first_launch(sched.executor)
        ended = []
        sched.on_output = ended.extend
        sched.submit(AddRequest(0, [5, 6, 7], greedy(4)))
        while sched.has_work:
            sched.step()
        assert [d.error for d in ended if d.error] and "injected kernel failure" in ended[0].error
        sched.on_output = collect
        out = llm.generate([[5, 6, 7]], greedy(4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4


def test_a_step_that_fails_inside_the_engine_after_staging_leaves_the_engine_serving(qwen3_path, monkeypatch):
    # the failure comes after the step's arrays took a staging slot: the slot must come back, or every
    # later step that reaches it in the ring fails too
    with checked_llm(qwen3_path) as llm:
        engine = llm.engine
        real = engine._forward_eager
        calls = {"n": 0}

        def fail_once(*args, **kw):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure inside the step")
            return real(*args, **kw)

        monkeypatch.setattr(engine, "_forward_eager", fail_once)
        with pytest.raises(Exception, match="injected failure inside the step"):
            llm.generate([[5, 6, 7]], greedy(4))
        prompts = [[5, 6, 7], [8, 9, 10, 11]]
        outs = llm.generate(prompts, greedy(6, ignore_eos=True))  # more steps than the ring has slots
        assert [o.token_ids for o in outs] == hf_greedy(qwen3_path, prompts, 6, ignore_eos=True)


def test_one_set_of_request_limits_names_the_field_at_fault():
    from cluster import RequestLimits

    limits = RequestLimits(max_seq_len=8, vocab_size=10, max_logit_bias=3, eos_ids=frozenset({9}), max_prompt_tokens=5)
    cases = [
        ([], SamplingParams(), "prompt", "empty"),
        ([1] * 6, SamplingParams(), "prompt", "at most 5"),
        ([1], SamplingParams(logit_bias={10: 1.0}), "logit_bias", "vocabulary"),
        ([1, 10], SamplingParams(), "prompt", "token id 10 is outside"),
        ([1], SamplingParams(min_tokens=2, stop_token_ids=[10]), "stop_token_ids", "token 10, outside"),
        ([1], SamplingParams(stop_token_ids=[-4]), "stop_token_ids", "token -4, outside"),
        ([-1, 1], SamplingParams(), "prompt", "token id -1 is outside"),
        (
            [1],
            SamplingParams(logit_bias={1: 1.0, 2: 1.0}, min_tokens=2, stop_token_ids=[3]),
            "logit_bias",
            "holds back 2",
        ),
    ]
    for ids, params, field, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as e:
            limits.check(ids, params)
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        RequestLimits(max_seq_len=8).check_prompt(8)  # the context must hold one new token too
    assert e.value.code == "context_length_exceeded"
    limits.check([1] * 5, SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}))
    limits.check([0, 9], SamplingParams())


def test_a_repeated_stop_token_id_is_held_back_once():
    from cluster import RequestLimits
    from cluster.limits import held_back_ids

    limits = RequestLimits(max_seq_len=8, vocab_size=10, max_logit_bias=3, eos_ids=frozenset({9}))
    repeated = SamplingParams(min_tokens=2, stop_token_ids=[3, 3, 3, 3, 3])
    # EOS and token 3: two entries of the table of 3, where five copies of 3 once counted as five
    assert held_back_ids(repeated, limits.eos_ids) == [9, 3]
    limits.check([1], repeated)  # within the table: not refused
    with pytest.raises(InvalidRequestError, match="max_logit_bias"):  # distinct ids past it still are
        limits.check([1], SamplingParams(min_tokens=2, stop_token_ids=[3, 4, 5, 3]))


def test_stop_token_ids_that_leave_min_tokens_no_token_to_sample_are_refused(qwen3_path):
    # every token banned until min_tokens: the sampler drew a banned one and the output ended at its first
    # token with finish reason stop
    with checked_llm(qwen3_path) as llm:
        vocab = llm.engine.hf_config.vocab_size
        everything = greedy(4, min_tokens=2, stop_token_ids=list(range(vocab)))
        with pytest.raises(InvalidRequestError, match="no token is left to sample") as e:
            llm.generate([[5, 6, 7]], everything)
        assert e.value.field == "stop_token_ids"
        eos = sorted(llm.scheduler.eos_ids)
        all_but_one = greedy(4, min_tokens=2, stop_token_ids=[t for t in range(vocab) if t != 7 and t not in eos])
        assert llm.generate([[5, 6, 7]], all_but_one)[0].token_ids[:2] == [7, 7]


def test_a_prompt_token_outside_the_vocabulary_is_refused_and_the_engine_serves_on(qwen3_path):
    # read by the embedding, such an id would fail its step and every request in it (on a GPU, an
    # out-of-bounds read that can take the device down)
    with checked_llm(qwen3_path) as llm:
        vocab = llm.engine.hf_config.vocab_size
        with pytest.raises(InvalidRequestError, match=f"token id {vocab} is outside") as e:
            llm.generate([[5, 6, vocab]], greedy(4))
        assert e.value.field == "prompt"
        good = [[5, 6, 7]]
        assert [o.token_ids for o in llm.generate(good, greedy(4))] == hf_greedy(qwen3_path, good, 4)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_decode_rows_sorted_longest_first_keep_every_output(qwen3_path, overlap):
    """Kernels.decode_order sorted_rows: every decode step's rows run longest KV first (so FlashInfer's
    kernels, which start their programs in row order, start the longest requests first), and each request
    keeps HF's greedy tokens: a row's output does not depend on its place. Without it, the same workload's
    rows run in running order, which is not sorted: the test would see it."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    max_tokens = [rng.randint(4, 20) for _ in prompts]
    orders = {}
    for decode_order in ("rows", "sorted_rows"):
        with checked_llm(
            qwen3_path,
            page_size=2,
            num_pages=400,
            max_extend_tokens=24,  # prompts admitted over several steps: the running order is not by length
            overlap=overlap,
            kernels=Kernels(decode_order=decode_order),
        ) as llm:
            launched = []
            launch = llm.scheduler.executor.launch

            def recording(desc, launch=launch):
                if not desc.is_prefill:
                    launched.append(desc.seq_lens.tolist())
                return launch(desc)

            llm.scheduler.executor.launch = recording
            outs = llm.generate(prompts, [greedy(n, ignore_eos=True) for n in max_tokens])
        assert [o.token_ids for o in outs] == [
            hf_greedy(qwen3_path, [p], n, ignore_eos=True)[0] for p, n in zip(prompts, max_tokens)
        ]
        orders[decode_order] = [lens == sorted(lens, reverse=True) for lens in launched if len(lens) > 1]
    assert all(orders["sorted_rows"]) and orders["sorted_rows"]
    assert not all(orders["rows"])


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", 2**63),  # past the device's int64 seeds: the step building its batch failed, the request stuck
        ("seed", -(2**63) - 1),
        ("seed", "x"),
        ("priority", None),  # not comparable with the queue's integers: every later step failed
        ("logprobs", True),  # a bool passed for 1 and failed its step at topk
        ("prompt_logprobs", True),
        ("temperature", float("inf")),  # 1/t is 0: masked logits became NaN
        ("temperature", 1e39),
        ("repetition_penalty", 1e39),  # inf in float32
        ("repetition_penalty", 1e-50),  # 0 in float32
    ],
)
def test_sampling_values_the_device_cannot_hold_are_refused_and_the_engine_serves_on(qwen3_path, field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    with checked_llm(qwen3_path) as llm:
        with pytest.raises(InvalidRequestError):
            llm.generate([[5, 6, 7]], SamplingParams(**{field: value}))
        assert [o.token_ids for o in llm.generate([[5, 6, 7]], greedy(4))] == hf_greedy(qwen3_path, [[5, 6, 7]], 4)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 2.5),  # ran as 3 tokens
        ("min_tokens", 1.5),
        ("n", 2.0),  # raised TypeError fanning out its choices
        ("top_k", 2.5),
        ("logprobs", 1.5),
        ("prompt_logprobs", 2.0),
        ("min_tokens", True),  # a bool passed for 1
        ("n", True),
        ("max_tokens", "4"),
        ("temperature", "1"),  # raised TypeError at its bound
        ("top_p", None),
        ("temperature", True),
        ("ignore_eos", "no"),  # true as a string
        ("stop_token_ids", 7),
        ("stop_token_ids", [7, 8.5]),
        ("stop_token_ids", [True]),
        ("logit_bias", [7]),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {7: "1"}),
        ("grammar", "json"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_none_for_stop_token_ids_or_logit_bias_is_none():
    params = SamplingParams(stop_token_ids=None, logit_bias=None, min_tokens=2)
    assert params.stop_token_ids == [] and params.logit_bias == {} and not params.for_choice(1).stop_token_ids


def test_numpy_scalars_become_pythons():
    params = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), stop_token_ids=(np.int32(7),))
    assert type(params.max_tokens) is int and type(params.temperature) is float
    assert params.stop_token_ids == [7] and type(params.stop_token_ids[0]) is int
