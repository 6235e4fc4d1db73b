"""Building one tensor-parallel rank's engine, the same way for rank 0 (the scheduler actor) and for
the followers: join the group when there is one, then load this rank's shard."""

from __future__ import annotations

from worker.comm import init_tensor_parallel
from worker.config import EngineConfig
from worker.engine import Engine, resolve_device


def build_rank(
    config: EngineConfig, rank: int = 0, size: int = 1, address: str | None = None, timeout_s: float = 60.0
) -> Engine:
    """`address`: the group's rendezvous (rank 0's host:port); unused when size is 1."""
    if size == 1:
        return Engine(config)
    tp = init_tensor_parallel(rank, size, address, resolve_device(config.device), timeout_s)
    return Engine(config, tp)
