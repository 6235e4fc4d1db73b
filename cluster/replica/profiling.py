"""cProfile over a replica's scheduler thread, for finding where its host time goes beside the offline
engine's (bench/first_token_hops.py --profile-replica): with RAYLM_PROFILE_SCHEDULER set to a path
prefix, the scheduler thread runs under cProfile and writes `<prefix>-replica<id>.pstats` when its loop
ends (the replica's shutdown). Off by default: cProfile slows every Python call of the loop."""

from __future__ import annotations

import cProfile
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

PROFILE_ENV = "RAYLM_PROFILE_SCHEDULER"


def run_profiled(loop: Callable[[], None], replica_id: int) -> None:
    """Runs loop(), under cProfile when RAYLM_PROFILE_SCHEDULER names where to write its statistics."""
    prefix = os.environ.get(PROFILE_ENV)
    if not prefix:
        loop()
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        loop()
    finally:
        profile.disable()
        path = f"{prefix}-replica{replica_id}.pstats"
        profile.dump_stats(path)
        log.warning("replica %d: the scheduler thread's profile is in %s", replica_id, path)
