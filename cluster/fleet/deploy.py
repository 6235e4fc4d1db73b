"""Placing a replica on Ray: a placement group with one bundle per rank, the scheduler actor in
bundle 0 and the followers in the others, joined in one tensor-parallel group."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ReplicaConfig
from cluster.fleet.address import probe_cluster
from cluster.messages import ReplicaInfo
from cluster.replica.actor import SchedulerActor
from worker.follower import Follower

log = logging.getLogger(__name__)
# how long a replica's scheduler is given to stop by itself before its ranks are killed
GRACEFUL_SHUTDOWN_S = 30.0


class ClusterAuthError(ConnectionError):
    """The Ray cluster asks for a token this process does not have."""


# Ray's worker_niceness for the workers this process starts (replicas, routers): 0 leaves them at its own
WORKER_NICENESS = 0


def ensure_ray(address: str | None = None, **init_options) -> str | None:
    """Connects to the Ray cluster at address, or starts a local one; reuses one already joined.
    Returns the dashboard's address when there is one."""
    if ray.is_initialized():
        return None
    if address is not None:
        probe_cluster(address)
        check_cluster_auth(address)
    if address is None:
        if not _has_gpu_locally():
            # without GPUs, ranks are CPU processes; let a small machine hold several of them
            init_options.setdefault("num_cpus", max(os.cpu_count() or 1, 8))
        init_options.setdefault("include_dashboard", False)
        # Ray starts its workers at nice 15 (for its own control processes' sake): a replica's scheduler
        # loop, which keeps the GPU fed, would then give way to any other process on the host, this
        # server's HTTP side first. 0 leaves them at this process's priority. A cluster started with
        # `ray start` takes RAY_worker_niceness=0 instead, and a user's RAY_worker_niceness is kept.
        if "RAY_worker_niceness" not in os.environ:
            system = init_options.setdefault("_system_config", {})
            system.setdefault("worker_niceness", WORKER_NICENESS)
    # "local" starts a new Ray even when another one runs on this machine
    with _interruptible(address is not None):
        context = ray.init(address=address or "local", **init_options)
    return getattr(context, "dashboard_url", None) or None


def local_ray_lost() -> bool:
    """Whether the Ray this process started has lost a process of its own (its GCS, its raylet). A SIGTERM
    sent to the whole process group, as `timeout`, `kill -TERM -PGID` and systemd's default stop send it,
    ends them beside this process, and every call to Ray would then wait a minute for a GCS that is gone:
    there is nothing left to stop. False where this process joined a cluster (it outlives us)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node is not None and node.head and not node.remaining_processes_alive()


@contextlib.contextmanager
def _interruptible(joining: bool):
    """While joining a cluster, Ctrl-C ends the process at once: Ray's connect waits in native code,
    where Python's handler would run only once it gives up. Nothing is started yet that needs stopping."""
    if not joining or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_cluster_auth(address: str) -> None:
    """A cluster started with `ray start` uses token authentication, which a driver uses only when
    RAY_AUTH_MODE=token is set before Ray is imported: without it, joining fails after 20 s of errors.
    Asks the cluster first (in milliseconds) and raises ClusterAuthError saying what to do."""
    if os.environ.get("RAY_AUTH_MODE"):
        return  # the user chose
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
        from ray._raylet import GcsClient

        GcsClient(address=canonicalize_bootstrap_address_or_die(address)).internal_kv_get(b"probe", b"raylm", timeout=2)
        return
    except Exception as e:  # noqa: BLE001 - anything but a refused token is ray.init's to report
        if type(e).__name__ != "AuthenticationError":
            return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        raise ClusterAuthError(
            f"the Ray cluster at {address} uses token authentication: run again with "
            f"RAY_AUTH_MODE=token set (the token in {token_file} is then used)"
        )
    raise ClusterAuthError(
        f"the Ray cluster at {address} uses token authentication: put its token (`ray "
        f"get-auth-token` on its head node prints it) in ~/.ray/auth_token here, and run again "
        f"with RAY_AUTH_MODE=token set"
    )


def control_store_answers(timeout_s: float) -> bool:
    """Whether Ray's control store (the GCS) answers within timeout_s. Without it nothing can be placed,
    replaced or restarted, while calls to running actors may still go through for a minute until the
    driver gives up: so a health check must ask it directly."""
    try:
        gcs = ray._private.worker.global_worker.gcs_client
        gcs.internal_kv_get(b"raylm-health-probe", b"raylm", timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - an RpcError when it is gone; anything else means the same here
        return False


def _has_gpu_locally() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def uses_gpus(config: ReplicaConfig) -> bool:
    if config.engine.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return config.engine.device.startswith("cuda")


def replica_bundles(tp_size: int, gpu: bool) -> list[dict[str, float]]:
    """A replica's placement group: one bundle per rank. What it asks for is what Ray's autoscaler
    sees as demand when no node has it free (a `ray up` cluster then adds a worker)."""
    return [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(tp_size)]


class ReplicaHandle:
    """The driver's handle on one replica: its actors and placement group."""

    def __init__(
        self,
        config: ReplicaConfig,
        replica_id: int = 0,
        ready_timeout_s: float = 600.0,
        abandon: threading.Event | None = None,
    ) -> None:
        """Places and starts the replica; blocks until it serves. `abandon` set while the placement
        group waits for resources, or while the replica starts, gives up (the server is stopping, or the
        replica is no longer wanted)."""
        self.config, self.replica_id = config, replica_id
        gpu = uses_gpus(config)
        # in the dashboard's names; a replacement gets a new suffix, so it never clashes with its predecessor
        self.suffix = uuid.uuid4().hex[:8]
        self.pg = placement_group(
            replica_bundles(config.tp_size, gpu),
            strategy=config.placement_strategy,
            name=f"raylm-replica-{replica_id}-{self.suffix}",
        )
        self.actor = None
        self.followers: list = []
        try:
            self._wait_placed(ready_timeout_s, abandon)
            self._start(gpu, ready_timeout_s, abandon)
        except BaseException:
            self.shutdown(graceful_s=0)  # it serves nothing yet; one hung while starting would not answer
            raise

    def _wait_placed(self, timeout_s: float, abandon: threading.Event | None) -> None:
        ready, deadline = self.pg.ready(), time.monotonic() + timeout_s
        while not ray.wait([ready], timeout=1.0)[0]:
            if abandon is not None and abandon.is_set():
                raise RuntimeError(f"replica {self.replica_id}: abandoned while waiting for resources")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.replica_id}: the cluster has not had {self.config.tp_size} "
                    f"free {'GPU' if 'GPU' in self.pg.bundle_specs[0] else 'CPU'} bundles "
                    f"for {timeout_s:g} s"
                )
        ray.get(ready)

    def _get(self, refs: list, timeout_s: float, abandon: threading.Event | None) -> list:
        """ray.get, giving up when abandon is set (an error on any ref raises at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            ray.get(done)  # raises at once if a rank failed to start
            if not pending:
                return ray.get(refs)
            if abandon is not None and abandon.is_set():
                raise RuntimeError(f"replica {self.replica_id}: abandoned while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.replica_id} did not start within {timeout_s:g} s")

    def _start(self, gpu: bool, timeout_s: float, abandon: threading.Event | None = None) -> None:
        cfg = self.config

        def placed(i: int) -> dict:
            return {
                "num_gpus": 1 if gpu else 0,
                "num_cpus": 1,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            }

        def name(rank: int) -> str:
            return f"raylm-replica-{self.replica_id}-rank-{rank}-{self.suffix}"

        # threads for the calls that wait (a long poll of the offline LLM, stats between steps, a
        # router's release) beside the health checks, which must never queue behind them
        self.actor = (
            ray.remote(SchedulerActor)
            .options(max_concurrency=16 + 65, name=name(0), **placed(0))
            .remote(cfg, self.replica_id)
        )
        address = self._get([self.actor.rendezvous_address.remote()], timeout_s, abandon)[0]
        self.followers = [
            ray.remote(Follower)
            .options(max_concurrency=2, name=name(rank), **placed(rank))
            .remote(cfg.ranks_engine, rank, cfg.tp_size, address, cfg.collective_timeout_s)
            for rank in range(1, cfg.tp_size)
        ]
        started = self._get(
            [self.actor.start.remote()] + [f.start.remote() for f in self.followers], timeout_s, abandon
        )
        self.info: ReplicaInfo = started[0]
        for follower in self.followers:
            # runs until rank 0 stops the group; Ray keeps an actor task running whether or not
            # anyone holds its result
            follower.run.remote()

    def shutdown(self, graceful_s: float = GRACEFUL_SHUTDOWN_S) -> None:
        """Stops every rank and removes the placement group; nothing is left behind. Idempotent. The
        scheduler is asked to stop first, for up to `graceful_s` (0: not asked, as for a replica that failed
        and would not answer), then every rank is killed."""
        if self.actor is not None and graceful_s > 0:
            try:
                ray.get(self.actor.shutdown.remote(), timeout=graceful_s)
            except Exception as e:  # noqa: BLE001 - it may be dead already
                log.info("replica %d scheduler did not shut down cleanly: %s", self.replica_id, e)
        for actor in [self.actor, *self.followers]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.actor, self.followers = None, []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
