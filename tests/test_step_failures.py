"""A step the engine fails leaves the caches true: nothing it never computed reaches the prefix cache,
and page-table rewrites it carried for other requests are not lost."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_prefill_puts_none_of_its_kv_in_the_prefix_cache(scripted, overlap):
    s = scripted(overlap=overlap, page_size=4)
    prompt = list(range(1, 10))  # 9 tokens: two whole pages
    s.executor.fail_next = RuntimeError("injected kernel failure")
    s.submit(0, prompt, max_tokens=2)
    s.run()
    assert s.ended[0] == "error"
    assert s.scheduler.cache.prefix_cache.num_pages == 0, "KV that was never computed is cached"
    s.submit(1, prompt, max_tokens=2)
    s.run()
    assert s.scheduler.snapshot().prefix_hit_tokens == 0  # nothing to hit: every prompt token computed
    s.check()


def test_a_failed_step_keeps_the_page_table_rewrites_it_carried_for_others(scripted):
    # prefill-first steps: the failing prefill then carries the rewrites without the decodes (a mixed
    # step would hold requests 0 and 1 too, and fail them with it)
    s = scripted(overlap=False, page_size=4, mixed_steps=False)
    prompt = list(range(1, 10))
    s.submit(0, prompt, max_tokens=30, ignore_eos=True)
    s.submit(1, prompt, max_tokens=30, ignore_eos=True)  # prefilled beside 0: its pages are duplicates
    s.scheduler.step()
    pending = set(s.scheduler.builder.rewrite_slots)  # rows the host changed, not yet on the device
    assert pending, "the second request's row points at the first one's pages now"
    s.executor.fail_next = RuntimeError("injected kernel failure")
    s.submit(2, [50, 51, 52], max_tokens=2)
    s.scheduler.step()  # the prefill of 2, carrying those rewrites, fails
    assert s.ended[2] == "error"
    s.scheduler.step()
    assert pending <= {slot for slot, _ in s.executor.launched[-1].prefix_slots}, "a rewrite was lost"
    s.run()
    assert s.ended[0] == s.ended[1] == "length"
    s.check()
