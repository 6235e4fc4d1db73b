"""What a router actor starts from: the deployment's settings, the replicas' model facts and the
replicas serving now, held by one named actor of the tier. A router fetches them when it starts
rather than taking them as its constructor's arguments: Ray keeps those (and any actor handle among
them) in its object store, and a restart fails once they are lost there. Ray restarts the directory
too (empty: it takes no arguments either), and the tier publishes to it again (router/tier/tier.py)."""

from __future__ import annotations

import ray

from cluster import ReplicaInfo, ServeConfig


def directory_name(port: int) -> str:
    return f"raylm-tier-{port}"


class TierDirectory:
    def __init__(self) -> None:
        self._spec: tuple[ServeConfig, ReplicaInfo, list] | None = None

    def publish(self, config: ServeConfig, info: ReplicaInfo, replicas: list) -> None:
        self._spec = (config, info, list(replicas))

    def set_replica(self, i: int, ref) -> None:
        """Replica i's replacement serves: a router starting from now on routes to it."""
        self._spec[2][i] = ref

    def add_replica(self, ref) -> None:
        """A replica joined the fleet (the autoscaler's), at the end."""
        self._spec[2].append(ref)

    def remove_last_replica(self) -> None:
        """The last replica leaves the fleet: a router starting from now on never routes to it."""
        self._spec[2].pop()

    def published(self) -> bool:
        return self._spec is not None

    def spec(self) -> tuple[ServeConfig, ReplicaInfo, list]:
        """The settings, the model facts and the router.tier.actor.ReplicaRef of each replica serving now."""
        if self._spec is None:
            raise RuntimeError("the router tier's directory was restarted and is not published yet")
        return self._spec


def start_directory(port: int, config: ServeConfig, info: ReplicaInfo, replicas: list, scheduling_strategy):
    """The tier's directory on the routers' node, published before any router starts."""
    directory = (
        ray.remote(TierDirectory)
        .options(name=directory_name(port), num_cpus=0, max_restarts=-1, scheduling_strategy=scheduling_strategy)
        .remote()
    )
    ray.get(directory.publish.remote(config, info, replicas), timeout=60)
    return directory


def read_directory(port: int) -> tuple[ServeConfig, ReplicaInfo, list]:
    """From within a router actor: what it starts from."""
    return ray.get(ray.get_actor(directory_name(port)).spec.remote(), timeout=60)
