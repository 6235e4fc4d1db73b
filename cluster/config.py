"""Scheduler configuration; the one place that reads the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

from worker.config import EngineConfig


def overlap_from_env(default: bool) -> bool:
    """RAYLM_OVERLAP=0 turns the overlap loop off everywhere (for ablations)."""
    value = os.environ.get("RAYLM_OVERLAP")
    return default if value is None else value not in ("0", "false", "False", "off")


@dataclass
class SchedulerConfig:
    cache_type: str = "radix"       # radix (prefix sharing) or naive
    max_extend_tokens: int = 8192   # prompt tokens per prefill step; longer prompts are chunked
    overlap: bool = True            # launch step N+1 before handling step N's results


@dataclass
class ReplicaConfig:
    """One replica: a scheduler (tensor-parallel rank 0) and tp_size - 1 followers."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    tp_size: int = 1
    collective_timeout_s: float = 60.0  # a collective stalled this long (a dead rank) fails the replica
    placement_strategy: str = "STRICT_PACK"  # PACK lets a replica span nodes
