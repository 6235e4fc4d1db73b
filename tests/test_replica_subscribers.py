"""Several routers on one replica (cluster/replica/subscribers.py): each subscriber (a router's index)
polls only its own requests' deltas and gets its own KV events (a snapshot first, then changes,
whatever the others took); a released router's requests are handed back for aborting, and so are a
silent router's; a failed replica answers every request with its error. Through the scheduler actor:
a restarted router's predecessor's requests are aborted, their pages freed."""

from __future__ import annotations

import threading
import time

from test_kv_events import in_process_replica, tree_hashes

from cluster import AddRequest, ErrorKind, SamplingParams, TokenDelta
from cluster.replica.subscribers import SUBSCRIBER_TIMEOUT_S, Subscribers
from cluster.scheduler.prefix_cache.events import KVEventStream


def _params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _over(scripted) -> tuple[Subscribers, object]:
    """Subscribers fed by a scripted scheduler, as the replica feeds them: a step's deltas with its cache's changes."""
    subs = Subscribers(KVEventStream(4))
    run = scripted(num_pages=24, page_size=4, max_running_reqs=4)
    run.scheduler.on_output = lambda deltas: subs.publish(deltas, *run.scheduler.cache.take_kv_events())
    return subs, run


def _submit(subs: Subscribers, run, requests: list[AddRequest], subscriber: int = 0) -> None:
    assert subs.submitted([r.uid for r in requests], subscriber)
    for r in requests:
        run.scheduler.submit(r)


def _step_all(subs: Subscribers, run) -> None:
    while run.scheduler.has_work:
        run.scheduler.step()
        subs.add_kv_events(*run.scheduler.cache.take_kv_events())


def test_each_subscriber_polls_its_own_requests_deltas(scripted):
    subs, run = _over(scripted)
    _submit(subs, run, [AddRequest(1, [1, 2, 3], _params())])  # the default subscriber, 0
    _submit(subs, run, [AddRequest(2, [4, 5, 6], _params()), AddRequest(3, [7, 8], _params())], subscriber=1)
    _submit(subs, run, [AddRequest(4, [9, 9, 9], _params())], subscriber=2)
    assert subs.owner(3) == 1 and subs.num_live == 4
    _step_all(subs, run)
    got = {s: subs.poll(0.0, subscriber=s) for s in (0, 1, 2)}
    assert {d.uid for d in got[0]} == {1} and {d.uid for d in got[1]} == {2, 3} and {d.uid for d in got[2]} == {4}
    for out in got.values():
        assert sum(d.finished for d in out) == len({d.uid for d in out})
        assert out.live == 0
    assert subs.owner(3) is None  # a finished request has no owner any more
    run.check()


def test_each_subscriber_gets_a_kv_snapshot_then_its_own_changes(scripted):
    subs, run = _over(scripted)
    cache = run.scheduler.cache.prefix_cache
    assert subs.poll(0.0, subscriber=0).kv_events.full
    _submit(subs, run, [AddRequest(1, list(range(1, 30)), _params(2))])
    _step_all(subs, run)
    first = subs.poll(0.0, subscriber=0).kv_events
    assert not first.full and set(first.stored) == tree_hashes(cache)
    late = subs.poll(0.0, subscriber=1).kv_events  # a second router: the whole cache, though 0 took the changes
    assert late.full and set(late.stored) == tree_hashes(cache)
    _submit(subs, run, [AddRequest(2, [40] * 21, _params(2))], subscriber=1)
    _step_all(subs, run)
    changes = {s: subs.poll(0.0, subscriber=s).kv_events for s in (0, 1)}
    assert changes[0] == changes[1] and changes[0] is not None and not changes[0].full
    assert subs.kv_receivers() == [0, 1]
    run.check()


def test_a_subscriber_that_polls_without_kv_events_is_kept_none():
    subs = Subscribers(KVEventStream(4))
    assert subs.poll(0.0, subscriber=3, kv_events=False).kv_events is None
    assert subs.kv_receivers() == []


def test_releasing_a_subscriber_returns_its_live_requests_and_drops_its_outbox():
    subs = Subscribers()
    subs.submitted([1], subscriber=1)
    subs.submitted([2, 3], subscriber=2)
    subs.publish([TokenDelta(2, 7)])
    assert subs.release(2) == [2, 3]
    assert subs.poll(0.0, subscriber=2) == []  # its waiting deltas were dropped
    assert subs.release(1) == [1] and subs.release(1) == [1]  # still live until the replica aborts it
    subs.aborted([1])
    assert subs.release(1) == [] and subs.num_live == 2


def test_a_router_that_stops_polling_is_released_and_the_launching_process_never_is():
    subs = Subscribers()
    subs.submitted([1], subscriber=1)
    subs.submitted([2], subscriber=2)
    for sub in (1, 2, 0):
        subs.poll(0.0, subscriber=sub)
    now = time.monotonic()
    assert subs.release_silent(now) == {}
    time.sleep(0.5)
    subs.poll(0.0, subscriber=2)  # router 2 polls again; router 1 and process 0 do not
    assert subs.release_silent(time.monotonic() + SUBSCRIBER_TIMEOUT_S - 0.25) == {1: [1]}


def test_a_failed_replica_ends_every_live_request_and_answers_later_ones_with_its_error():
    subs = Subscribers()
    subs.submitted([1], subscriber=1)
    subs.submitted([2], subscriber=0)
    assert subs.fail("a rank died") == 2 and subs.fail("again") is None
    assert subs.failed == "a rank died"
    for sub, uid in ((1, 1), (0, 2)):
        (d,) = subs.poll(0.0, subscriber=sub)
        assert (d.uid, d.finished, d.error_kind, d.error) == (uid, True, ErrorKind.REPLICA_DOWN, "a rank died")
    assert subs.publish([TokenDelta(1, 5)]) == []  # ended already: nothing more reaches it
    assert not subs.submitted([3], subscriber=1)
    assert [(d.uid, d.error) for d in subs.poll(0.0, subscriber=1)] == [(3, "a rank died")]


def test_a_step_wakes_only_the_polls_of_routers_it_has_deltas_for():
    """An idle router's poll sleeps through the steps of other routers' requests (woken at every step,
    it would take the interpreter from the scheduler thread for nothing)."""
    subs = Subscribers()
    subs.submitted([1], subscriber=1)
    got: dict[int, list] = {}

    def poll(sub: int) -> None:
        got[sub] = subs.poll(5.0, subscriber=sub)

    threads = {sub: threading.Thread(target=poll, args=(sub,)) for sub in (1, 2)}
    for t in threads.values():
        t.start()
    time.sleep(0.2)  # both polls wait
    subs.publish([TokenDelta(1, 9)])
    threads[1].join(timeout=2)
    assert not threads[1].is_alive() and [d.uid for d in got[1]] == [1]
    assert threads[2].is_alive()  # not woken: it has nothing
    subs.close()  # a stopping replica ends every poll at once
    threads[2].join(timeout=2)
    assert not threads[2].is_alive() and got[2] == []


def test_a_restarted_routers_predecessor_has_its_requests_aborted_and_pages_freed(scripted):
    actor, run = in_process_replica(scripted)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    actor.submit([AddRequest(1, [1, 2, 3], long)], subscriber=1)
    actor.submit([AddRequest(2, [4, 5, 6], long), AddRequest(3, [6, 7], long)], subscriber=2)
    for _ in range(3):
        actor.scheduler.step()
    assert actor.release_subscriber(2) == 2
    assert actor.poll(0.0, subscriber=2) == []
    while actor.scheduler.has_work:
        actor.scheduler.step()
    out = actor.poll(0.0, subscriber=1)
    assert out[-1].uid == 1 and out[-1].finished and out.live == 0
    assert actor.scheduler.snapshot().running == 0
    run.check()


def test_a_router_that_stops_polling_has_its_requests_aborted_on_the_replica(scripted):
    actor, run = in_process_replica(scripted)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    actor.submit([AddRequest(1, [1, 2, 3], long)], subscriber=1)
    actor.submit([AddRequest(2, [4, 5, 6], long)], subscriber=2)
    for sub in (1, 2, 0):
        actor.poll(0.0, subscriber=sub)
    time.sleep(0.5)
    actor.poll(0.0, subscriber=2)  # router 2 polls again later; router 1 does not
    assert actor.reap_silent_subscribers(time.monotonic() + SUBSCRIBER_TIMEOUT_S - 0.25) == [1]
    while actor.scheduler.has_work:
        actor.scheduler.step()
    assert [d.uid for d in actor.poll(0.0, subscriber=2) if d.finished] == [2]
    assert actor.scheduler.snapshot().running == 0
    run.check()
