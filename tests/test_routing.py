"""Choosing a replica: prefix affinity with a load-balance fallback, and round-robin."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.routing import CacheAware, NoReplicaError, RoundRobin


@dataclass
class FakeReplica:
    replica_id: int
    load: int = 0
    healthy: bool = True


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
