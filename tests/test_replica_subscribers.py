"""Several routers on one replica: each subscriber (a router's index) polls only its own requests'
deltas and gets its own KV events (a snapshot first, then changes, whatever the others took); a
restarted router releases what its predecessor sent, which the replica aborts, pages freed, and so
does a router that stops polling."""

from __future__ import annotations

from test_kv_events import in_process_replica, tree_hashes

from cluster import AddRequest, SamplingParams


def _step_all(actor) -> None:
    while actor.scheduler.has_work:
        actor.scheduler.step()
        actor._take_kv_events()


def _params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_each_subscriber_polls_its_own_requests_deltas(scripted):
    actor, run = in_process_replica(scripted)
    actor.submit([AddRequest(1, [1, 2, 3], _params())])                  # the default subscriber, 0
    actor.submit([AddRequest(2, [4, 5, 6], _params()), AddRequest(3, [7, 8], _params())], subscriber=1)
    actor.submit([AddRequest(4, [9, 9, 9], _params())], subscriber=2)
    _step_all(actor)
    got = {s: actor.poll(0.0, subscriber=s) for s in (0, 1, 2)}
    assert {d.uid for d in got[0]} == {1} and {d.uid for d in got[1]} == {2, 3} and {d.uid for d in got[2]} == {4}
    for out in got.values():
        assert sum(d.finished for d in out) == len({d.uid for d in out})
        assert out.live == 0
    assert not actor._owner  # finished requests forget their owner
    run.check()


def test_each_subscriber_gets_a_kv_snapshot_then_its_own_changes(scripted):
    actor, run = in_process_replica(scripted)
    cache = run.scheduler.cache.prefix_cache
    assert actor.poll(0.0, subscriber=0).kv_events.full
    actor.submit([AddRequest(1, list(range(1, 30)), _params(2))])
    _step_all(actor)
    first = actor.poll(0.0, subscriber=0).kv_events
    assert not first.full and set(first.stored) == tree_hashes(cache)
    late = actor.poll(0.0, subscriber=1).kv_events  # a second router: the whole cache, though 0 took the changes
    assert late.full and set(late.stored) == tree_hashes(cache)
    actor.submit([AddRequest(2, [40] * 21, _params(2))], subscriber=1)
    _step_all(actor)
    changes = {s: actor.poll(0.0, subscriber=s).kv_events for s in (0, 1)}
    assert changes[0] == changes[1] and changes[0] is not None and not changes[0].full
    run.check()


def test_releasing_a_subscriber_aborts_its_requests_and_leaves_the_others(scripted):
    actor, run = in_process_replica(scripted)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    actor.submit([AddRequest(1, [1, 2, 3], long)], subscriber=1)
    actor.submit([AddRequest(2, [4, 5, 6], long), AddRequest(3, [6, 7], long)], subscriber=2)
    for _ in range(3):
        actor.scheduler.step()
    assert actor.release_subscriber(2) == 2
    assert actor.poll(0.0, subscriber=2) == []  # its waiting deltas were dropped
    _step_all(actor)
    out = actor.poll(0.0, subscriber=1)
    assert out[-1].uid == 1 and out[-1].finished and out.live == 0
    assert actor.scheduler.snapshot().running == 0
    run.check()


def test_a_router_that_stops_polling_has_its_requests_aborted(scripted):
    import time

    from cluster.replica import SUBSCRIBER_TIMEOUT_S
    actor, run = in_process_replica(scripted)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    actor.submit([AddRequest(1, [1, 2, 3], long)], subscriber=1)
    actor.submit([AddRequest(2, [4, 5, 6], long)], subscriber=2)
    actor.poll(0.0, subscriber=1)
    actor.poll(0.0, subscriber=2)
    actor.poll(0.0, subscriber=0)
    now = time.monotonic()
    assert actor.reap_silent_subscribers(now) == []
    actor._last_poll[2] = now + SUBSCRIBER_TIMEOUT_S  # router 2 polls again later; router 1 and process 0 do not
    assert actor.reap_silent_subscribers(now + SUBSCRIBER_TIMEOUT_S + 1) == [1]  # 0 is never reaped
    _step_all(actor)
    assert [d.uid for d in actor.poll(0.0, subscriber=2) if d.finished] == [2]
    assert actor.scheduler.snapshot().running == 0
    run.check()


def test_a_step_wakes_only_the_polls_of_routers_it_has_deltas_for(scripted):
    """An idle router's poll sleeps through the steps of other routers' requests (woken at every step,
    it would take the interpreter from the scheduler thread for nothing)."""
    import threading

    actor, run = in_process_replica(scripted)
    for sub in (1, 2):
        actor.poll(0.0, subscriber=sub)  # each router has polled once: its condition exists
    woken = {1: 0, 2: 0}

    class Counting(threading.Condition):
        def __init__(self, sub: int) -> None:
            super().__init__(actor._lock)
            self.sub = sub

        def notify_all(self) -> None:
            woken[self.sub] += 1
            super().notify_all()

    actor._wakeups.update({sub: Counting(sub) for sub in (1, 2)})
    actor.submit([AddRequest(1, [1, 2, 3], _params(4))], subscriber=1)
    _step_all(actor)
    assert woken[1] >= 4 and woken[2] == 0
    assert [d.uid for d in actor.poll(0.0, subscriber=1)] == [1] * 4 and actor.poll(0.0, subscriber=2) == []
    run.check()
