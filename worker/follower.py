"""A follower rank (1..tp-1): it runs no scheduling logic, it applies every batch description rank 0
broadcasts, as soon as it arrives. Deployed as a Ray actor by the control plane."""

from __future__ import annotations

import logging
import os

import torch

from worker.comm import Keepalive, destroy_tensor_parallel
from worker.config import EngineConfig
from worker.engine import Engine
from worker.rank import build_rank

log = logging.getLogger(__name__)


def node_and_pid() -> tuple[str, int]:
    """This Ray worker's node id and process id (tests stall or kill a rank by its pid)."""
    import ray

    return ray.get_runtime_context().get_node_id(), os.getpid()


class Follower:
    def __init__(self, config: EngineConfig, rank: int, size: int, address: str, timeout_s: float) -> None:
        self.config, self.rank, self.size = config, rank, size
        self.address, self.timeout_s = address, timeout_s
        self.engine: Engine | None = None

    def node_and_pid(self) -> tuple[str, int]:
        return node_and_pid()

    def start(self) -> None:
        """Joins the group and loads this rank's shard of the model."""
        self.engine = build_rank(self.config, self.rank, self.size, self.address, self.timeout_s)

    def run(self) -> str:
        """Applies broadcast steps until rank 0 says stop (or the group breaks)."""
        comm = self.engine.tp.comm
        try:
            with torch.inference_mode():
                while (desc := comm.broadcast_desc(None)) is not None:
                    if not isinstance(desc, Keepalive):
                        self.engine.forward(desc)
        except Exception as e:  # noqa: BLE001 - rank 0 died or the group timed out: this rank is done
            log.warning("follower rank %d stops: %s", self.rank, e)
            return f"stopped: {e}"
        finally:
            destroy_tensor_parallel()
        return "stopped"
