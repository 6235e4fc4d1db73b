"""The autoscaling policy on its own (no Ray): the replicas it wants from the replicas' load figures
over time, and the replica range's settings; and the autoscaler's drain over stand-in replicas."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, ServeConfig
from cluster.fleet.autoscale import AutoscalePolicy, AutoscaleSettings, ReplicaLoad

SETTINGS = AutoscaleSettings(min_replicas=1, max_replicas=3, queue_per_replica=2, up_delay_s=5.0, down_delay_s=30.0)
BUSY, IDLE = ReplicaLoad(waiting=6, running=4), ReplicaLoad(waiting=0, running=0)


def test_a_queue_above_the_threshold_adds_a_replica_once_it_lasted_the_up_delay():
    policy = AutoscalePolicy(SETTINGS)
    assert policy.decide([BUSY], now=100.0).wanted == 1
    assert policy.decide([BUSY], now=104.9).wanted == 1
    decision = policy.decide([BUSY], now=105.0)
    assert decision.wanted == 2 and "6 request(s) waiting, more than 2 per replica on 1 replica(s)" in decision.why


def test_queued_prompt_tokens_above_their_threshold_add_a_replica_too():
    settings = AutoscaleSettings(1, 3, queue_per_replica=8, up_delay_s=0.0, down_delay_s=30.0)
    long_prompts = ReplicaLoad(waiting=2, running=4, queued_tokens=20_000)
    assert AutoscalePolicy(settings).decide([long_prompts], now=0.0).wanted == 1  # requests alone: not short
    with_tokens = AutoscalePolicy(dataclasses.replace(settings, queued_tokens_per_replica=16_384))
    decision = with_tokens.decide([long_prompts], now=0.0)
    assert decision.wanted == 2 and "20000 prompt token(s) queued" in decision.why


def test_a_request_waiting_past_the_ttft_target_adds_a_replica_too():
    settings = AutoscaleSettings(1, 3, queue_per_replica=8, up_delay_s=0.0, down_delay_s=30.0, ttft_target_s=2.0)
    policy = AutoscalePolicy(settings)
    assert policy.decide([ReplicaLoad(waiting=1, running=4, oldest_wait_s=1.5)], now=0.0).wanted == 1
    decision = policy.decide([ReplicaLoad(waiting=1, running=4, oldest_wait_s=2.5)], now=1.0)
    assert decision.wanted == 2 and "past the TTFT target of 2 s" in decision.why


def test_a_queue_that_drops_below_the_threshold_starts_the_up_delay_again():
    policy = AutoscalePolicy(SETTINGS)
    policy.decide([BUSY], now=0.0)
    policy.decide([ReplicaLoad(waiting=2, running=4)], now=4.0)  # 2 per replica: not above
    assert policy.decide([BUSY], now=6.0).wanted == 1
    assert policy.decide([BUSY], now=11.0).wanted == 2


def test_the_threshold_is_per_replica():
    policy = AutoscalePolicy(SETTINGS)
    two = [ReplicaLoad(waiting=2, running=4), ReplicaLoad(waiting=2, running=4)]  # 4 waiting: 2 per replica
    policy.decide(two, now=0.0)
    assert policy.decide(two, now=10.0).wanted == 2


def test_a_new_replica_gets_its_own_up_delay_before_the_next_one():
    policy = AutoscalePolicy(SETTINGS)
    policy.decide([BUSY], now=0.0)
    assert policy.decide([BUSY], now=5.0).wanted == 2
    assert policy.decide([BUSY, BUSY], now=6.0).wanted == 2  # the new replica has just joined
    assert policy.decide([BUSY, BUSY], now=11.0).wanted == 3


def test_the_fleet_never_grows_past_max_replicas():
    policy = AutoscalePolicy(SETTINGS)
    three = [BUSY] * 3
    policy.decide(three, now=0.0)
    assert policy.decide(three, now=1000.0).wanted == 3


def test_replicas_an_operator_drained_count_against_max_replicas():
    policy = AutoscalePolicy(SETTINGS)
    two = [BUSY] * 2
    policy.decide(two, now=0.0, held=1)
    assert policy.decide(two, now=1000.0, held=1).wanted == 2  # 2 serving + 1 drained: max_replicas 3
    assert AutoscalePolicy(SETTINGS).decide([], now=0.0, held=3).wanted == 0  # all drained: none to add
    # below min_replicas serving, a replica is added while the fleet stays within max_replicas
    assert AutoscalePolicy(SETTINGS).decide([], now=0.0, held=1).wanted == 1


def test_an_idle_fleet_loses_one_replica_per_down_delay_down_to_min_replicas():
    policy = AutoscalePolicy(SETTINGS)
    policy.decide([IDLE] * 3, now=0.0)
    assert policy.decide([IDLE] * 3, now=29.0).wanted == 3
    assert policy.decide([IDLE] * 3, now=30.0).wanted == 2
    policy.decide([IDLE] * 2, now=31.0)  # one removed: the delay starts again
    assert policy.decide([IDLE] * 2, now=60.0).wanted == 2
    assert policy.decide([IDLE] * 2, now=61.0).wanted == 1
    policy.decide([IDLE], now=62.0)
    assert policy.decide([IDLE], now=1000.0).wanted == 1


def test_a_fleet_whose_every_replica_holds_requests_is_not_idle():
    policy = AutoscalePolicy(SETTINGS)
    busy_enough = [ReplicaLoad(waiting=0, running=1), ReplicaLoad(waiting=0, running=3)]
    policy.decide(busy_enough, now=0.0)
    assert policy.decide(busy_enough, now=1000.0).wanted == 2
    one_empty = [ReplicaLoad(waiting=0, running=1), IDLE]
    policy.decide(one_empty, now=1000.0)
    assert policy.decide(one_empty, now=1030.0).wanted == 1


def test_a_request_waiting_anywhere_stops_the_down_delay():
    policy = AutoscalePolicy(SETTINGS)
    policy.decide([IDLE, IDLE], now=0.0)
    policy.decide([IDLE, ReplicaLoad(waiting=1, running=5)], now=20.0)
    assert policy.decide([IDLE, IDLE], now=35.0).wanted == 2
    assert policy.decide([IDLE, IDLE], now=65.0).wanted == 1


def test_a_fleet_below_min_replicas_wants_min_replicas_at_once():
    settings = AutoscaleSettings(min_replicas=2, max_replicas=4, queue_per_replica=2, up_delay_s=5, down_delay_s=5)
    assert AutoscalePolicy(settings).decide([IDLE], now=0.0).wanted == 2


def test_a_replica_range_turns_autoscaling_on_and_the_fleet_starts_within_it():
    assert not ServeConfig().autoscaling
    assert ServeConfig().replica_range == (1, 1)
    config = ServeConfig().override(model="m", max_replicas=4)
    assert config.autoscaling and config.replica_range == (1, 4) and config.initial_replicas == 1
    config = ServeConfig().override(model="m", min_replicas=2, max_replicas=4, replicas=8)
    assert config.initial_replicas == 4
    settings = AutoscaleSettings.of(config.override(autoscale_queue_per_replica=7))
    assert (settings.min_replicas, settings.max_replicas, settings.queue_per_replica) == (2, 4, 7)


@pytest.mark.parametrize(
    "values,key,words",
    [
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas", "at least min_replicas (3)"),
        ({"min_replicas": 2}, "max_replicas", "required with min_replicas"),
        # tuning an autoscaler that never runs: once accepted without a word
        ({"autoscale_up_delay_s": 3, "autoscale_ttft_target_s": 0.5}, "max_replicas", "autoscale_ttft_target_s, "),
    ],
)
def test_a_replica_range_that_holds_no_replica_is_refused_naming_the_setting(values, key, words):
    config = ServeConfig().override(model="m", **values)
    with pytest.raises(ConfigError) as e:
        config.validate()
    assert e.value.key == key and words in e.value.problem


def test_min_replicas_of_zero_is_refused():
    with pytest.raises(ConfigError, match="min_replicas must be an integer >= 1"):
        ServeConfig().override(min_replicas=0)


class _Stats:
    def __init__(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting, self.running, self.live = waiting, running, waiting + running
        self.queued_tokens, self.oldest_wait_s = 0, 0.0


class _Client:
    """A replica as the autoscaler sees it: its own figures, and what this router has on it."""

    def __init__(self, replica_id: int, stats: _Stats) -> None:
        self.replica_id, self.stats, self.healthy, self.load = replica_id, stats, True, stats.live
        self.draining = False
        self.moving: dict = {}
        self.outgoing: list[_Client] = []
        self.waiting: list[int] = []  # this router's requests waiting on it (sent, no token yet)
        self.handed: list[tuple[int, _Client]] = []

        async def stats_call():
            return self.stats

        self.actor = SimpleNamespace(stats=SimpleNamespace(remote=stats_call))

    async def stop(self) -> None:
        pass

    def hand_over(self, count: int, to: _Client) -> int:
        self.handed.append((count, to))
        return count


class _Fleet:
    closed = False

    def __init__(self) -> None:
        self.added = self.removed = 0

    def add(self):
        self.added += 1
        return None  # never starts one: the test watches whether it was asked

    def remove_last(self):
        self.removed += 1


def _autoscaler(clients: list[_Client]):
    from router.http.metrics import RouterMetrics
    from router.http.state import RouterState
    from router.tier.autoscaler import Autoscaler

    config = ServeConfig().override(
        model="m", max_replicas=2, autoscale_queue_per_replica=1, autoscale_up_delay_s=0, autoscale_down_delay_s=0
    )
    state = RouterState(
        config=config, tokenizer=None, model_name="m", max_seq_len=64, vocab_size=10, metrics=RouterMetrics("m")
    )
    state.clients = clients
    fleet = _Fleet()
    return Autoscaler(state, fleet, SimpleNamespace(replacing=set())), state, fleet


def test_a_draining_replica_takes_requests_again_when_they_queue_instead_of_a_new_one_starting():
    clients = [_Client(0, _Stats(running=1)), _Client(1, _Stats(running=1))]
    clients[1].stats = _Stats()  # its replica is empty: the fleet is idle
    autoscaler, state, fleet = _autoscaler(clients)
    clients[1].load = 1  # a stream this router sent it has not ended yet

    asyncio.run(autoscaler.step())
    assert state.retiring == {1} and [c.replica_id for c in state.routable] == [0]
    clients[0].stats = _Stats(waiting=5, running=2)  # requests queue on the one left
    clients[0].load, clients[0].waiting = 4, [7, 8, 9]  # this router's share: three of them wait
    asyncio.run(autoscaler.step())
    assert state.retiring == set() and fleet.added == 0 and fleet.removed == 0
    assert autoscaler.wanted == 2
    assert clients[0].handed == [(1, clients[1])]  # loads 4 and 1 even out at 3 and 2


def test_a_drained_replica_is_removed_only_once_nothing_of_its_requests_is_left():
    clients = [_Client(0, _Stats(running=1)), _Client(1, _Stats())]
    autoscaler, state, fleet = _autoscaler(clients)
    clients[1].load = 1  # this router still waits for a stream's end from it
    asyncio.run(autoscaler.step())
    asyncio.run(autoscaler.step())
    assert state.retiring == {1} and fleet.removed == 0 and len(state.clients) == 2
    clients[1].load = 0
    clients[1].stats = _Stats(running=1)  # another router's request is still running there
    asyncio.run(autoscaler.step())
    assert fleet.removed == 0
    clients[1].stats = _Stats()
    asyncio.run(autoscaler.step())
    assert fleet.removed == 1 and len(state.clients) == 1 and state.retiring == set()


def test_a_busy_fleet_beside_a_drained_replica_stays_within_max_replicas():
    clients = [_Client(0, _Stats(waiting=9, running=4)), _Client(1, _Stats())]
    clients[1].draining = True  # an operator's drain: out of routing, still on its GPUs
    autoscaler, state, fleet = _autoscaler(clients)  # max_replicas 2, a queue of 1 a replica adds one
    for _ in range(3):
        asyncio.run(autoscaler.step())
    assert fleet.added == 0 and autoscaler.wanted == 1 and state.retiring == set()
    clients[1].draining = False  # undrained: the fleet may grow again, to its bound
    clients[0].stats = clients[1].stats = _Stats(waiting=9, running=4)
    asyncio.run(autoscaler.step())
    assert fleet.added == 0 and autoscaler.wanted == 2


def test_a_drained_replica_stays_drained_when_its_replacement_installs():
    _, state, _ = _autoscaler([_Client(0, _Stats()), _Client(1, _Stats())])
    state.clients[1].draining = True
    state.set_client(1, _Client(1, _Stats()))
    assert state.clients[1].draining and [c.replica_id for c in state.routable] == [0]
    state.set_client(0, _Client(0, _Stats()))
    assert not state.clients[0].draining


def test_no_replica_is_started_once_the_server_drains_to_stop():
    """A backlog old enough to grow the fleet as SIGTERM comes: on a `ray up` cluster a start would ask
    for a node the stopping server never uses."""
    clients = [_Client(0, _Stats(waiting=9, running=4))]
    autoscaler, state, fleet = _autoscaler(clients)
    state.draining = True
    asyncio.run(autoscaler.step())
    assert fleet.added == 0
    state.draining = False
    asyncio.run(autoscaler.step())
    assert fleet.added == 1  # the same backlog grows it while serving


def test_a_failed_replica_is_not_counted_as_running_while_it_is_replaced():
    clients = [_Client(0, _Stats(running=1)), _Client(1, _Stats(running=1))]
    autoscaler, state, _ = _autoscaler(clients)
    asyncio.run(autoscaler.step())
    assert autoscaler.running == 2
    clients[1].healthy = False  # failed: the supervisor replaces it
    asyncio.run(autoscaler.step())
    assert autoscaler.running == 1 and autoscaler._size == (autoscaler.wanted, 1)  # exported though healing


def test_a_start_that_takes_long_is_given_up_once_the_fleet_is_idle_as_long_as_would_remove_a_replica():
    """On a `ray up` cluster a replica may wait minutes for a node, or hang while starting: the load that
    wanted it may be gone meanwhile. Its start is given up (no failure counted), and scale-down goes on."""
    from concurrent.futures import Future

    class SlowFleet(_Fleet):
        def __init__(self) -> None:
            super().__init__()
            self.future: Future | None = None
            self.abandoned = 0

        def add(self):
            self.added += 1
            self.future = Future()
            return self.future

        def abandon_add(self) -> bool:
            self.abandoned += 1
            self.future.set_exception(RuntimeError("replica 1: abandoned while waiting for resources"))
            return True

    clients = [_Client(0, _Stats(waiting=9, running=4))]
    autoscaler, state, _ = _autoscaler(clients)  # delays of 0
    fleet = autoscaler.fleet = SlowFleet()

    async def rounds() -> None:
        await autoscaler.step()
        assert fleet.added == 1 and autoscaler._adding is not None
        await autoscaler.step()  # still busy: the start goes on
        assert fleet.abandoned == 0
        clients[0].stats = _Stats()  # the load is gone
        await autoscaler.step()
        await asyncio.sleep(0)  # the start's end is taken in
        await asyncio.sleep(0)

    asyncio.run(rounds())
    assert fleet.abandoned == 1 and autoscaler._adding is None
    assert autoscaler.failed_starts == 0 and autoscaler.wanted == 1


def test_a_replica_that_joins_while_the_figures_come_is_not_followed_by_another_start():
    """The figures of a round asked while a replica starts are those of the fleet without it: should it join
    meanwhile, they say nothing of the fleet it is now (a start on them would be one more than wanted)."""
    from concurrent.futures import Future

    class OneFleet(_Fleet):
        def add(self):
            self.added += 1
            self.future = Future()
            return self.future

    clients = [_Client(0, _Stats(waiting=9, running=4))]
    autoscaler, state, _ = _autoscaler(clients)  # max_replicas 2
    fleet = autoscaler.fleet = OneFleet()
    joined = _Client(1, _Stats(waiting=9, running=4))

    async def rounds() -> None:
        await autoscaler.step()
        assert fleet.added == 1

        async def stats_while_it_joins():
            fleet.future.set_result(SimpleNamespace(replica_id=1))  # it serves as the figures come
            await asyncio.sleep(0)
            return clients[0].stats

        clients[0].actor = SimpleNamespace(stats=SimpleNamespace(remote=stats_while_it_joins))
        await autoscaler.step()
        assert fleet.added == 1

    import router.tier.autoscaler as module

    real = module.client_for
    module.client_for = lambda *args, **kw: joined
    joined.start = lambda: None
    try:
        asyncio.run(rounds())
    finally:
        module.client_for = real
