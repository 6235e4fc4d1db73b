"""Rebalancing when a replica joins the routing, without Ray: the plan evens out the loads by moving
only waiting requests, and never between replicas within one of each other; the router's clients hand
the last-sent waiting requests over, each generation moves its request to the replica it was handed
to as it was first sent (aborted where it waited), or keeps it there when that replica has no room;
what the old replica sent after the notice is dropped, so each stream is whole."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from cluster import AddRequest, ReplicaOutput, SamplingParams, TokenDelta
from router.replicas.client import ReplicaClient
from router.replicas.generation import Generation, Timing
from router.replicas.migration import Migration
from router.replicas.rebalance import Move, plan, rebalance


def test_a_replica_that_joins_takes_half_of_a_backlog():
    assert plan([10, 0], [8, 0]) == [Move(0, 1, 5)]


def test_only_waiting_requests_move():
    assert plan([10, 0], [3, 0]) == [Move(0, 1, 3)]
    assert plan([10, 0], [0, 0]) == []


def test_loads_within_one_of_each_other_stay_and_a_gap_of_two_closes():
    assert plan([5, 4, 5], [5, 4, 5]) == []
    assert plan([5, 3], [5, 3]) == [Move(0, 1, 1)]


def test_several_busy_replicas_share_their_waiting_requests_with_several_new_ones():
    moves = plan([12, 9, 0, 0], [6, 6, 0, 0])
    loads = [12, 9, 0, 0]
    for m in moves:
        loads[m.source] -= m.count
        loads[m.target] += m.count
    assert sorted(loads) == [5, 5, 5, 6]
    assert all(m.source in (0, 1) and m.target in (2, 3) for m in moves)


def test_a_plan_of_mismatched_lists_is_an_error():
    with pytest.raises(ValueError, match="3 loads against 2"):
        plan([1, 2, 3], [0, 0])


class _Detok:
    stopped = False

    def add(self, token: int, ends: bool = False) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


def _client(replica_id: int) -> ReplicaClient:
    """A real client whose channel never connects: what it would send stays in _submits and _aborts."""
    return ReplicaClient(replica_id, actor=None)


def _migration(state: dict) -> Migration:
    def rehome(request, to):
        return to if state["room"] else None

    m = Migration(2, lambda request, failed: None, state["uids"].__next__, rehome=rehome)
    m.counted = state["counted"].append
    return m


def _finish(client: ReplicaClient, uid: int, tokens: list[int]) -> None:
    last = len(tokens) - 1
    deltas = [
        TokenDelta(uid, t, finished=k == last, finish_reason="length" if k == last else None)
        for k, t in enumerate(tokens)
    ]
    client._take(ReplicaOutput(deltas))


@pytest.mark.parametrize("room", [True, False])
def test_the_last_sent_waiting_requests_move_to_the_replica_that_joined_and_every_stream_is_whole(room):
    state = {"room": room, "counted": [], "uids": itertools.count(100)}

    async def main():
        busy, new = _client(0), _client(1)
        params = SamplingParams(temperature=0.0, max_tokens=3)
        requests = [AddRequest(uid, [1, 2, uid], params) for uid in range(5)]
        gens = [Generation(busy, [r], [_Detok()], Timing(), _migration(state)) for r in requests]
        texts = [asyncio.ensure_future(_text(g)) for g in gens]
        assert list(busy.queued) == [0, 1, 2, 3, 4]  # each generation submitted as it was made
        busy._take(ReplicaOutput([TokenDelta(0, 7)]))  # request 0 has its first token: it runs, not waits

        handed = rebalance([busy, new])
        assert handed == 2 and set(busy.moving) == {3, 4}  # loads 5 and 0: the last two sent of those waiting
        await _notices_taken(busy)
        _finish(busy, 0, [8, 9])
        # what the busy replica sends for a handed-over request after the notice is dropped
        for uid in (1, 2, 3, 4):
            _finish(busy, uid, [uid, uid, uid])
        moved = {r.uid: r for r in new._submits}
        if room:
            assert [r.input_ids for r in moved.values()] == [[1, 2, 3], [1, 2, 4]]
            assert all(r.output_len == 0 and r.params == params for r in moved.values())
            assert busy._aborts == [3, 4] and state["counted"] == ["rebalanced", "rebalanced"]
            for r in moved.values():
                _finish(new, r.uid, [50, 51, 52])
        else:
            assert not moved and not busy._aborts and not state["counted"]
        assert not busy.moving and not busy.queues
        return await asyncio.gather(*texts)

    texts = asyncio.run(main())
    assert texts[0] == "<7><8><9>" and texts[1:3] == ["<1><1><1>", "<2><2><2>"]
    assert texts[3:] == (["<50><51><52>"] * 2 if room else ["<3><3><3>", "<4><4><4>"])


async def _text(g: Generation) -> str:
    return "".join([piece.text async for piece in g])


async def _notices_taken(client: ReplicaClient) -> None:
    """Lets the generations run until each has taken its notice (a few turns of the loop)."""
    for _ in range(100):
        if not client.moving:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"notices not taken: {client.moving}")


def test_a_handed_over_request_whose_first_token_or_end_came_before_its_notice_was_taken_stays():
    """The notice is in the queue first, the token or the end after it: the generation finds the request
    no longer waiting, so it neither moves it nor takes the notice for a drain or a failure."""
    state = {"room": True, "counted": [], "uids": itertools.count(100)}

    async def main():
        busy, new = _client(0), _client(1)
        params = SamplingParams(temperature=0.0, max_tokens=2)
        gens = [
            Generation(busy, [AddRequest(uid, [1, uid], params)], [_Detok()], Timing(), _migration(state))
            for uid in range(4)
        ]
        texts = [asyncio.ensure_future(_text(g)) for g in gens]
        assert rebalance([busy, new]) == 2 and set(busy.moving) == {2, 3}
        busy._take(ReplicaOutput([TokenDelta(2, 20)]))  # a first token before the notice is taken
        _finish(busy, 3, [30, 31])  # the whole request before the notice is taken
        await _notices_taken(busy)
        for uid in (0, 1):
            _finish(busy, uid, [uid, uid])
        _finish(busy, 2, [21])
        assert not new._submits and not busy._aborts and not state["counted"]
        return await asyncio.gather(*texts)

    assert asyncio.run(main()) == ["<0><0>", "<1><1>", "<20><21>", "<30><31>"]


def test_a_second_rebalance_counts_the_requests_the_first_handed_over_where_they_go():
    async def main():
        a, b, c = _client(0), _client(1), _client(2)
        for uid in range(12):
            a.submit(uid, [1, 2], SamplingParams())
        assert rebalance([a, b]) == 6  # 12 and 0: 6 and 6
        # 6, 6 and 0, the six not moved yet counted on b (they are bound for it): 3, 6 and 3
        assert rebalance([a, b, c]) == 3
        assert [to.replica_id for to in a.outgoing].count(2) == 3

    asyncio.run(main())


def test_a_client_hands_over_no_more_than_it_has_waiting_and_none_twice():
    async def main():
        busy, new = _client(0), _client(1)
        for uid in range(3):
            busy.submit(uid, [1, 2], SamplingParams())
        assert busy.hand_over(2, new) == 2 and busy.waiting == [0]
        assert busy.hand_over(5, new) == 1 and busy.waiting == []
        notices = [busy.queues[uid].get_nowait() for uid in (2, 1, 0)]
        assert all(d.error is not None and not d.finished for d in notices)
        assert rebalance([busy, new]) == 0  # nothing left to move: loads count the handed-over ones as gone
        busy.abort(1)
        assert 1 not in busy.moving

    asyncio.run(main())


def test_an_undrained_replica_takes_over_requests_waiting_on_the_others():
    from cluster.config import ServeConfig
    from router.http.metrics import RouterMetrics
    from router.http.state import RouterState

    async def main():
        state = RouterState(
            config=ServeConfig().override(model="m"),
            tokenizer=None,
            model_name="m",
            max_seq_len=64,
            vocab_size=10,
            metrics=RouterMetrics("m"),
        )
        busy, drained = _client(0), _client(1)
        state.clients = [busy, drained]
        await drained.drain()  # nothing of this router's on it: returns at once, out of routing
        for uid in range(4):
            busy.submit(uid, [1, 2], SamplingParams())
        assert state.routable == [busy]
        assert state.undrain_replica(1) == 2
        assert state.routable == [busy, drained] and [to.replica_id for to in busy.outgoing] == [1, 1]
        # a drain still emptying the replica is not undone
        drained.submit(9, [1, 2], SamplingParams())
        draining = asyncio.ensure_future(drained.drain())
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="still being drained"):
            state.undrain_replica(1)
        drained.abort(9)  # its generation moved it: the drain returns
        assert await draining == 1
        # with rebalance_on_join off it is routed to again and nothing moves
        state.config = ServeConfig().override(model="m", rebalance_on_join=False)
        assert state.undrain_replica(1) == 0 and state.routable == [busy, drained]

    asyncio.run(main())
