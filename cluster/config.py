"""Scheduler configuration; the one place that reads the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass


def overlap_from_env(default: bool) -> bool:
    """RAYLM_OVERLAP=0 turns the overlap loop off everywhere (for ablations)."""
    value = os.environ.get("RAYLM_OVERLAP")
    return default if value is None else value not in ("0", "false", "False", "off")


@dataclass
class SchedulerConfig:
    cache_type: str = "radix"       # radix (prefix sharing) or naive
    max_extend_tokens: int = 8192   # prompt tokens per prefill step; longer prompts are chunked
    overlap: bool = True            # launch step N+1 before handling step N's results
