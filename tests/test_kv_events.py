"""KV events: the block hashes a router learns from a replica equal what the replica's radix cache
holds, through inserts, edge splits and evictions (recomputed from the tree's own tokens); a receiver
that starts late gets a snapshot first; and through real replicas on Ray, cache-exact routing sends a
prompt to the replica that holds its prefix."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from helpers import serving

from cluster import AddRequest, KVEvents, ReplicaOutput, SamplingParams, TokenDelta, block_hashes
from cluster.replica.actor import SchedulerActor
from cluster.scheduler.prefix_cache.events import KVEventStream
from cluster.scheduler.prefix_cache.radix import RadixCache
from router.replicas.client import ReplicaClient

PAGE = 2


def tree_hashes(cache: RadixCache) -> set[int]:
    """Every block the tree holds, hashed anew from the tokens on its path from the root."""
    out, stack = set(), [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + node.tokens
        out.update(block_hashes(path, cache.page_size))
        stack.extend((child, path) for child in node.children.values())
    return out


def receiver() -> ReplicaClient:
    return ReplicaClient(0, SimpleNamespace())


@pytest.mark.parametrize("seed", range(4))
def test_a_receivers_view_equals_the_radix_tree_through_inserts_splits_and_evictions(seed: int):
    rng = random.Random(seed)
    cache, stream, router = RadixCache(PAGE), KVEventStream(PAGE), receiver()
    # few distinct tokens: prompts share prefixes, so edges are split and partly evicted
    prompts = [[rng.randrange(3) for _ in range(PAGE * rng.randrange(1, 8))] for _ in range(40)]
    next_page, held, removed = 0, [], 0
    for _ in range(300):
        for _ in range(rng.randrange(1, 5)):  # a step's operations
            op = rng.random()
            if op < 0.4:
                ids = rng.choice(prompts)
                handle, _ = cache.insert(ids, list(range(next_page, next_page + len(ids) // PAGE)))
                next_page += len(ids) // PAGE
                if rng.random() < 0.3:
                    cache.lock(handle)
                    held.append(handle)
            elif op < 0.6:
                cache.match(rng.choice(prompts))
            elif op < 0.7 and held:
                cache.unlock(held.pop(rng.randrange(len(held))))
            else:
                cache.evict(rng.randrange(1, 4))
        stored, gone = cache.take_events()
        removed += len(gone)
        stream.add(stored, gone)
        if rng.random() < 0.5:  # the receiver does not poll every step: changes of several steps merge
            router.apply_kv_events(stream.take())
            assert router.kv_blocks == tree_hashes(cache) == stream.held
    router.apply_kv_events(stream.take())
    assert router.kv_blocks == tree_hashes(cache)
    assert removed > 50  # evictions were exercised


def test_a_late_receiver_gets_a_snapshot_and_ignores_changes_before_it():
    cache, stream = RadixCache(PAGE), KVEventStream(PAGE)
    first = receiver()
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    stream.add(*cache.take_events())
    first.apply_kv_events(stream.take())  # a new stream starts with a snapshot
    cache.insert([1, 2, 9, 9], [3, 4])
    stream.add(*cache.take_events())
    late = receiver()
    late.apply_kv_events(stream.take())  # changes only: the late receiver knows nothing yet
    assert late.kv_blocks is None
    stream.resync()
    cache.evict(2)
    stream.add(*cache.take_events())
    full = stream.take()
    assert full.full and full.page_size == PAGE
    late.apply_kv_events(full)
    assert late.kv_blocks == tree_hashes(cache) and len(late.kv_blocks) == 2


def test_the_scheduler_reports_what_its_cache_holds_as_requests_finish_and_evict(scripted):
    """Multi-turn chats over a cache too small for them: the events drained after each step (as the
    replica does) keep a receiver's view equal to the cache."""
    run = scripted(num_pages=40, page_size=4, max_running_reqs=4)
    sched, stream, router = run.scheduler, KVEventStream(4), receiver()
    rng = random.Random(0)
    chats = [[100 + c] * 12 for c in range(6)]
    uid, removed = 0, 0
    for _turn in range(4):
        for chat in chats:
            chat.extend(rng.randrange(1, 50) for _ in range(8))
            run.submit(uid, list(chat), max_tokens=3)
            uid += 1
        while sched.has_work:
            sched.step()
            stored, gone = sched.cache.take_kv_events()
            removed += len(gone)
            stream.add(stored, gone)
            router.apply_kv_events(stream.take())
            assert router.kv_blocks == tree_hashes(sched.cache.prefix_cache)
    run.check()
    assert removed > 0 and router.kv_blocks


def in_process_replica(scripted) -> tuple[SchedulerActor, object]:
    """A SchedulerActor over a scripted scheduler, stepped by the test instead of its loop's thread."""
    actor = SchedulerActor.__new__(SchedulerActor)
    SchedulerActor.__init__(actor, SimpleNamespace(log_level="warning"))
    run = scripted(num_pages=24, page_size=4, max_running_reqs=4)
    run.scheduler.on_output = lambda deltas: actor.subscribers.publish(deltas, *run.scheduler.cache.take_kv_events())
    actor.scheduler = run.scheduler
    actor.metrics = SimpleNamespace(on_output=lambda d: None, on_first_token=lambda hops: None)
    actor.subscribers.kv = KVEventStream(4)
    return actor, run


def run_one(actor: SchedulerActor, uid: int, ids: list[int]) -> ReplicaOutput:
    """Runs a request to its end (as the loop does) and polls once."""
    actor.submit([AddRequest(uid, ids, SamplingParams(max_tokens=2, temperature=0))])
    while actor.scheduler.has_work:
        actor.scheduler.step()
        actor.subscribers.add_kv_events(*actor.scheduler.cache.take_kv_events())
    return actor.poll(0.0)


def test_a_replica_sends_a_snapshot_first_then_a_finished_requests_blocks_with_its_last_delta(scripted):
    actor, run = in_process_replica(scripted)
    cache = run.scheduler.cache.prefix_cache
    first = actor.poll(0.0)
    assert first.kv_events == KVEvents(4, [], [], full=True)  # a new replica's first message
    out = run_one(actor, 1, list(range(1, 30)))
    assert out[-1].finished and not out.kv_events.full
    assert set(out.kv_events.stored) == tree_hashes(cache) and len(out.kv_events.stored) == 7
    assert actor.poll(0.0).kv_events is None  # nothing changed since


def test_a_router_that_connects_late_gets_the_whole_cache_then_changes(scripted):
    actor, run = in_process_replica(scripted)
    cache = run.scheduler.cache.prefix_cache
    serving = receiver()
    serving.apply_kv_events(actor.poll(0.0).kv_events)
    for uid in range(4):  # 24 pages: later prompts evict earlier ones
        serving.apply_kv_events(run_one(actor, uid, [uid + 1] * 30).kv_events)
    assert serving.kv_blocks == tree_hashes(cache)
    late = receiver()
    actor.kv_subscribe()
    late.apply_kv_events(actor.poll(0.0).kv_events)
    assert late.kv_blocks == tree_hashes(cache)
    late.apply_kv_events(run_one(actor, 9, [50] * 30).kv_events)
    assert late.kv_blocks == tree_hashes(cache)
    run.check()


def test_a_replica_output_is_a_list_of_deltas_with_its_kv_events_beside():
    import pickle

    out = ReplicaOutput([TokenDelta(1, 5)], KVEvents(4, [11], [12]))
    back = pickle.loads(pickle.dumps(out))
    assert list(back) == [TokenDelta(1, 5)] and back.kv_events == KVEvents(4, [11], [12])


def test_cache_exact_routes_to_the_replica_holding_the_prefix_on_ray(ray_cluster, qwen3_path):
    import ray

    with serving(qwen3_path, replicas=2, routing="cache_exact", num_pages=256, max_running_reqs=8) as srv:
        clients = srv.state.clients
        prompt = [5 + (i % 97) for i in range(64)]

        def complete(ids: list[int]) -> None:
            import httpx

            r = httpx.post(
                srv.url + "/v1/completions",
                json={"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0},
                timeout=60,
            )
            assert r.status_code == 200, r.text

        complete(prompt)
        deadline = time.monotonic() + 10
        hashes = block_hashes(prompt[:-1], 4)
        while not any(c.kv_blocks and hashes[-1] in c.kv_blocks for c in clients):
            assert time.monotonic() < deadline, "no replica reported the prompt's blocks"
            time.sleep(0.05)
        holder = next(i for i, c in enumerate(clients) if hashes[-1] in c.kv_blocks)
        before = [s.prefix_hit_tokens for s in ray.get([r.actor.stats.remote() for r in srv.replicas])]
        for k in range(3):
            complete(prompt + [200 + k] * 8)
        after = [s.prefix_hit_tokens for s in ray.get([r.actor.stats.remote() for r in srv.replicas])]
        assert after[holder] - before[holder] >= 3 * 60 and after[1 - holder] == before[1 - holder]

        # what the router has learnt is what the replica's cache holds
        held = ray.get(
            srv.replicas[holder].actor.__ray_call__.remote(
                lambda self: self.scheduler.call_between_steps(lambda: self.subscribers.kv.held.copy()).result(
                    timeout=10
                )
            )
        )
        assert clients[holder].kv_blocks == held
