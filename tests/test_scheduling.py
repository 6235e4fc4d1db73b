"""Scheduling decisions at the scheduler's own API, over a scripted executor (no model): admission,
chunked prefill, the prefix cache, decode batches, preemption, aborts, request slots and priorities."""

from __future__ import annotations

import pytest
from scripted import EOS, TOKEN

from cluster.sampling_params import SamplingParams
from cluster.scheduler.req import Req

LOOPS = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])


def first_delta(run, uid: int) -> int:
    return next(i for i, d in enumerate(run.deltas) if d.uid == uid)


@LOOPS
def test_requests_are_admitted_in_arrival_order_as_pages_allow(scripted, overlap):
    # 16 pages of 4 tokens; each long request reserves 7 (20 prompt + 8 new tokens): two fit at a time
    run = scripted(num_pages=16, page_size=4, overlap=overlap)
    cache = run.scheduler.cache

    def never_over_committed(desc):
        assert cache.reserved <= cache.allocator.num_free + cache.prefix_cache.num_evictable
        return [TOKEN] * desc.batch_size

    run.executor.tokens = never_over_committed
    for uid in range(3):
        run.submit(uid, [uid + 1] * 20, max_tokens=8, ignore_eos=True)
    run.submit(3, [9, 9, 9], max_tokens=1)  # small enough to fit at once, but it came last
    run.run()
    assert run.executor.launched[0].batch_size == 2
    assert first_delta(run, 1) < first_delta(run, 2) < first_delta(run, 3)
    assert [len(run.tokens(uid)) for uid in range(4)] == [8, 8, 8, 1]
    run.check()


@LOOPS
def test_a_long_prompt_is_prefilled_in_chunks_and_only_its_last_chunk_samples(scripted, overlap):
    run = scripted(max_extend_tokens=5, overlap=overlap)
    run.submit(0, list(range(1, 13)), max_tokens=3)
    run.run()
    prefills = [d.extend_lens.tolist() for d in run.executor.launched if d.is_prefill]
    assert prefills == [[5], [5], [2]]
    assert run.tokens(0) == [TOKEN] * 3 and run.ended[0] == "length"
    run.check()


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_a_cached_prefix_is_not_computed_again_and_its_pages_go_into_the_page_table(scripted, cache_type):
    run = scripted(page_size=4, cache_type=cache_type)
    prompt = list(range(1, 18))  # 17 tokens: four whole pages, then one token
    run.submit(0, prompt, max_tokens=2)
    run.run()
    run.submit(1, prompt + [50, 51], max_tokens=2)
    run.run()
    second = [d for d in run.executor.launched if d.is_prefill][-1]
    stats = run.scheduler.snapshot()
    if cache_type == "radix":
        assert second.extend_lens.tolist() == [3] and stats.prefix_hit_tokens == 16
        [(row, locs)] = second.prefix_slots
        assert row == second.slots[0] and len(locs) == 16
    else:
        assert second.extend_lens.tolist() == [19] and stats.prefix_hit_tokens == 0
        assert second.prefix_slots == []
    assert stats.prefill_tokens == 17 + second.extend_lens.sum()
    run.check()


def test_a_decode_step_computes_one_token_per_running_request_at_its_next_position(scripted):
    run = scripted(page_size=4)
    prompts = [[1] * 5, [2] * 6, [3] * 7]
    for uid, ids in enumerate(prompts):
        run.submit(uid, ids, max_tokens=4, ignore_eos=True)
    run.run()
    decodes = [d for d in run.executor.launched if not d.is_prefill]
    assert decodes[0].seq_lens.tolist() == [6, 7, 8] and decodes[0].input_ids is None
    for step, desc in enumerate(decodes):
        assert desc.extend_lens.tolist() == [1, 1, 1]
        assert desc.seq_lens.tolist() == [6 + step, 7 + step, 8 + step]
        assert len(set(desc.out_loc.tolist())) == 3  # each request writes its own KV location
    run.check()


@LOOPS
def test_requests_past_their_reservation_are_preempted_newest_first_and_lose_no_token(scripted, overlap):
    # each reserves 3 pages (8 prompt tokens + 1), then grows to 8 pages: all four cannot fit in 16
    run = scripted(num_pages=16, page_size=4, decode_reserve_tokens=1, overlap=overlap)
    for uid in range(4):
        run.submit(uid, [uid + 1] * 8, max_tokens=24, ignore_eos=True)
    run.run()
    assert run.scheduler.snapshot().preempted == sum(run.preempted.values()) > 0
    assert run.preempted[0] == 0 and run.preempted[3] > 0  # the oldest runs through
    assert [len(run.tokens(uid)) for uid in range(4)] == [24] * 4
    assert all(reason == "length" for reason in run.ended.values())
    run.check()


def test_the_finished_flag_comes_with_the_last_token_and_nothing_after_it(scripted):
    prompt = [1, 2, 3, 4]
    # the third output token is EOS for request 1: it is sampled at sequence length 4 + 2
    run = scripted(
        lambda desc: [EOS if (i, n) == (1, 6) else TOKEN for i, n in enumerate(desc.seq_lens.tolist())], overlap=True
    )
    run.submit(0, prompt, max_tokens=3, ignore_eos=True)
    run.submit(1, prompt, max_tokens=8)
    run.run()
    assert [d.finished for d in run.deltas if d.uid == 0] == [False, False, True]
    assert run.tokens(1) == [TOKEN, TOKEN, EOS] and run.deltas[-1].uid == 1 and run.deltas[-1].finished
    run.check()


def test_an_abort_while_the_prefill_is_in_flight_drops_its_result(scripted):
    run = scripted(overlap=True)
    run.submit(0, [1, 2, 3, 4, 5], max_tokens=8)
    run.scheduler.step()  # the prefill is launched, its result not handled
    run.scheduler.abort(0)
    run.run()
    assert run.deltas == [] and run.ended == {0: "abort"}
    run.check()


@LOOPS
def test_one_request_slot_serves_requests_that_end_at_their_first_token(scripted, overlap):
    # under overlap each request's decode step is in flight when its EOS is handled: its request slot
    # must wait for that step (RequestSlots.allocate raises otherwise)
    run = scripted(lambda desc: [EOS] * desc.batch_size, max_running_reqs=1, overlap=overlap)
    for uid in range(6):
        run.submit(uid, [uid + 1] * 3, max_tokens=5)
    run.run()
    assert [run.tokens(uid) for uid in range(6)] == [[EOS]] * 6
    run.check()


@LOOPS
def test_an_engine_failure_fails_that_steps_requests_and_the_rest_go_on(scripted, overlap):
    run = scripted(overlap=overlap)
    run.submit(0, [1, 2, 3], max_tokens=4)
    run.scheduler.step()
    run.executor.fail_next = RuntimeError("injected kernel failure")
    run.submit(1, [4, 5, 6], max_tokens=4)
    run.run()
    failed = [d for d in run.deltas if d.error is not None]
    assert failed and all("injected kernel failure" in d.error for d in failed)
    assert {d.uid for d in failed} | {uid for uid, reason in run.ended.items() if reason == "length"} == {0, 1}
    run.check()


def _req(uid: int, priority: int, arrival: float) -> Req:
    req = Req(uid, [1, 2, 3], SamplingParams(priority=priority), 8, seed=0)
    req.arrival = arrival
    return req


def test_the_queue_is_ordered_by_priority_then_arrival_and_a_preempted_request_goes_before_later_ones(scripted):
    run = scripted()
    prefill = run.scheduler.prefill
    for req in [_req(1, 0, 1.0), _req(2, 5, 2.0), _req(3, -1, 3.0), _req(4, 0, 4.0)]:
        prefill.add(req)
    prefill.add(_req(0, 0, 0.5))  # preempted: it came before the others of priority 0
    assert [r.uid for r in prefill.waiting] == [3, 0, 1, 4, 2]
    run.scheduler.check_integrity()


@LOOPS
def test_a_high_priority_request_admitted_behind_low_priority_ones_starts_first(scripted, overlap):
    run = scripted(max_running_reqs=1, overlap=overlap)
    for uid in range(4):
        run.submit(uid, [uid + 1] * 5, max_tokens=4, priority=5)
    run.scheduler.step()  # request 0 runs; 1, 2 and 3 wait for its request slot
    run.submit(9, [9] * 5, max_tokens=4, priority=-1)
    run.run()
    assert sorted([0, 1, 2, 3, 9], key=lambda uid: first_delta(run, uid)) == [0, 9, 1, 2, 3]
    assert all(len(run.tokens(uid)) == 4 for uid in (0, 1, 2, 3, 9))
    run.check()


@LOOPS
def test_a_chunked_prefill_at_the_head_keeps_its_place_before_a_higher_priority_request(scripted, overlap):
    run = scripted(max_extend_tokens=5, overlap=overlap)
    run.submit(0, list(range(1, 13)), max_tokens=3, priority=3)
    run.scheduler.step()  # its first chunk of 5
    run.submit(1, [20, 21, 22], max_tokens=3, priority=-5)
    run.run()
    prefills = [d.extend_lens.tolist() for d in run.executor.launched if d.is_prefill]
    assert prefills == [[5], [5], [2, 3]]  # its chunks go on; the newcomer takes what the budget leaves
    assert run.tokens(0) == [TOKEN] * 3 and run.tokens(1) == [TOKEN] * 3
    run.check()


@LOOPS
def test_preemption_takes_the_lowest_priority_first_then_the_newest(scripted, overlap):
    # the preemption test's four requests; the oldest has the lowest priority (the highest number)
    run = scripted(num_pages=16, page_size=4, decode_reserve_tokens=1, overlap=overlap)
    for uid in range(4):
        run.submit(uid, [uid + 1] * 8, max_tokens=24, ignore_eos=True, priority=9 if uid == 0 else 0)
    while run.scheduler.snapshot().preempted == 0:
        run.scheduler.step()
    assert [r.uid for r in run.scheduler.prefill.waiting] == [0]
    run.run()
    assert run.preempted[0] > 0 and run.preempted[1] == 0  # the oldest of priority 0 runs through
    assert [len(run.tokens(uid)) for uid in range(4)] == [24] * 4
    run.check()


@pytest.mark.parametrize("live", [1, 6])
def test_under_overlap_a_prompts_first_token_goes_out_before_the_next_launch_at_low_load(scripted, live):
    """With few requests live (FIRST_TOKEN_FIRST_MAX_LIVE) a step that ends a prompt is handled before the
    next step is launched, so the first token does not wait for that launch; with more the loop keeps its
    overlap and the first tokens follow the next launch."""
    from cluster.scheduler.scheduler import FIRST_TOKEN_FIRST_MAX_LIVE

    run = scripted(overlap=True)
    delivered_at_launch = []  # how many deltas had gone out when each step launched
    launch = run.executor.launch

    def counted(desc):
        delivered_at_launch.append(len(run.deltas))
        return launch(desc)

    run.executor.launch = counted
    for uid in range(live):
        run.submit(uid, [uid + 1, 2, 3, 4], max_tokens=3)
    run.run()
    prompt_step = next(i for i, d in enumerate(run.executor.launched) if d.is_prefill)
    first_tokens_out = delivered_at_launch[prompt_step + 1]  # deltas out when the step after the prompts launched
    assert 1 <= FIRST_TOKEN_FIRST_MAX_LIVE < 6  # the premise: one request is few, six are many
    assert first_tokens_out == {1: 1, 6: 0}[live]
    assert all(run.tokens(uid) == [TOKEN] * 3 for uid in range(live))
    run.check()
