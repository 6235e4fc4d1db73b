"""A drain through the router tier: with router actors serving, the deployment's drain reaches every
router, whose streams on the drained replica move to the other one, whole and exact."""

from __future__ import annotations

import ray
from helpers import serving
from test_migration_serving import _body, _check_whole, run_streams


def test_a_drain_reaches_every_router_actor_and_their_streams_move_whole(ray_cluster, qwen3_path):
    with serving(qwen3_path, replicas=2, routers=2, num_pages=1024, max_running_reqs=16, routing="round_robin") as srv:
        bodies = [_body(i) for i in range(8)]
        undisturbed, _ = run_streams(srv, bodies)
        streams, moved = run_streams(srv, bodies, lambda: srv.drain_replica(0))
        _check_whole(streams, undisturbed)
        assert moved > 0
        # the routers route nothing more to it, and hold nothing on it
        assert ray.get([a.in_flight.remote() for a in srv.tier.actors]) == [0, 0]
        for replica in srv.replicas:
            ray.get(replica.actor.check_integrity.remote())
            assert ray.get(replica.actor.stats.remote()).live == 0
