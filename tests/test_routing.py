"""Choosing a replica: on the replicas' cache contents (their KV events) with a load bound and a
power-of-two-choices fallback, on prefix affinity with a load-balance fallback, and round-robin."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster import KVEvents, block_hashes
from router.replicas.client import ReplicaClient
from router.replicas.routing import CacheAware, CacheExact, NoReplicaError, RoundRobin, create_policy


@dataclass
class FakeReplica:
    replica_id: int
    load: int = 0
    healthy: bool = True
    kv_blocks: set[int] | None = None
    page_size: int | None = 4

    @property
    def routing_load(self) -> int:
        return self.load

    def holds(self, ids: list[int]) -> FakeReplica:
        self.kv_blocks = (self.kv_blocks or set()) | set(block_hashes(ids, self.page_size))
        return self


SYSTEM = list(range(100, 164))  # 16 pages of 4


def test_cache_exact_sends_a_prompt_to_the_replica_holding_its_longest_prefix():
    replicas = [FakeReplica(0).holds(SYSTEM[:16]), FakeReplica(1, load=3).holds(SYSTEM), FakeReplica(2)]
    assert CacheExact().pick(replicas, SYSTEM + [1, 2, 3]).replica_id == 1


def test_cache_exact_stops_sending_a_prompt_where_its_prefix_was_evicted():
    """As the router's client sees it: the replica's KV events remove the prefix's blocks."""
    holder, other = ReplicaClient(0, None), ReplicaClient(1, None)
    hashes = block_hashes(SYSTEM, 4)
    holder.apply_kv_events(KVEvents(4, hashes, [], full=True))
    other.apply_kv_events(KVEvents(4, [], [], full=True))
    policy = CacheExact(seed=0)
    assert {policy.pick([holder, other], SYSTEM + [9]).replica_id for _ in range(10)} == {0}
    holder.apply_kv_events(KVEvents(4, [], hashes[1:]))  # evicted but the first page
    other.apply_kv_events(KVEvents(4, hashes[:4], []))
    assert policy.pick([holder, other], SYSTEM + [9]).replica_id == 1


def test_cache_exact_skips_a_holder_much_busier_than_the_least_loaded():
    holder, idle = FakeReplica(0, load=20).holds(SYSTEM), FakeReplica(1, load=2)
    policy = CacheExact(balance_abs=8, balance_rel=1.5)
    assert policy.pick([holder, idle], SYSTEM + [1]) is idle
    holder.load = 10  # within least + 8
    assert policy.pick([holder, idle], SYSTEM + [1]) is holder
    holder.load, idle.load = 140, 100  # beyond least + 8, within least * 1.5
    assert policy.pick([holder, idle], SYSTEM + [1]) is holder


def test_cache_exact_falls_back_to_the_less_loaded_of_two_when_nothing_matches():
    replicas = [FakeReplica(0, load=1).holds(SYSTEM), FakeReplica(1, load=5), FakeReplica(2, load=9)]
    policy = CacheExact(seed=0)
    picked = [policy.pick(replicas, list(range(500, 540))).replica_id for _ in range(60)]
    assert set(picked) == {0, 1}  # two drawn, the less loaded taken: the busiest never is
    assert picked.count(0) > picked.count(1)


def test_cache_exact_hashes_with_each_replicas_page_size():
    small, large = FakeReplica(0, page_size=2), FakeReplica(1, page_size=8).holds(SYSTEM)
    small.kv_blocks = set(block_hashes(SYSTEM, 4))  # hashed with the wrong page size: no match
    assert CacheExact().pick([small, large], SYSTEM + [1]) is large


def test_a_replica_without_a_snapshot_yet_is_routed_to_by_load_only():
    fresh = ReplicaClient(0, None)
    fresh.apply_kv_events(KVEvents(4, block_hashes(SYSTEM, 4), []))  # changes before any snapshot
    assert fresh.kv_blocks is None
    busy = FakeReplica(1, load=4)
    assert CacheExact(seed=0).pick([fresh, busy], SYSTEM + [1]) is fresh


def test_cache_exact_balances_on_what_the_replica_holds_from_every_router():
    """A router that sent a replica little may still find it busy with other routers' requests."""
    holder, idle = ReplicaClient(0, None), ReplicaClient(1, None)
    holder.apply_kv_events(KVEvents(4, block_hashes(SYSTEM, 4), [], full=True))
    idle.apply_kv_events(KVEvents(4, [], [], full=True))
    holder.replica_live = 30  # from its last message: none of them this router's
    assert CacheExact(seed=0).pick([holder, idle], SYSTEM + [1]) is idle
    holder.replica_live = 5
    assert CacheExact(seed=0).pick([holder, idle], SYSTEM + [1]) is holder


def test_every_routing_setting_names_a_policy():
    from cluster.config import ServeConfig, settings

    choices = settings(ServeConfig)["routing"].choices
    assert {type(create_policy(name)) for name in choices} == {CacheExact, CacheAware, RoundRobin}


def test_cache_aware_sends_a_shared_prefix_where_it_went_before():
    policy, replicas = CacheAware(block=4), [FakeReplica(0), FakeReplica(1)]
    system = list(range(100, 140))
    first = policy.pick(replicas, system + [1, 2, 3])
    first.load += 1
    # the least loaded replica would be the other one; the prefix wins while the load gap is small
    assert policy.pick(replicas, system + [7, 8, 9]) is first


def test_cache_aware_falls_back_to_the_least_loaded_when_the_affine_replica_is_busy():
    policy, replicas = CacheAware(block=4, balance_slack=2), [FakeReplica(0), FakeReplica(1)]
    prompt = list(range(50))
    first = policy.pick(replicas, prompt)
    first.load = 10
    assert policy.pick(replicas, prompt) is not first


def test_unrelated_prompts_spread_over_idle_replicas_and_unhealthy_ones_are_skipped():
    policy, replicas = CacheAware(block=4), [FakeReplica(0), FakeReplica(1), FakeReplica(2, healthy=False)]
    picked = {policy.pick(replicas, [i * 1000 + j for j in range(20)]).replica_id for i in range(4)}
    assert picked == {0, 1}
    replicas[0].healthy = replicas[1].healthy = False
    with pytest.raises(NoReplicaError):
        policy.pick(replicas, [1, 2, 3, 4])


def test_round_robin_cycles_over_healthy_replicas():
    policy, replicas = RoundRobin(), [FakeReplica(0), FakeReplica(1, healthy=False), FakeReplica(2)]
    assert [policy.pick(replicas, [1]).replica_id for _ in range(4)] == [0, 2, 0, 2]
