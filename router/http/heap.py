"""The startup heap moved out of the garbage collector's reach, in a process that serves HTTP.

By the time a router serves, imports and startup (torch, transformers, Ray, FastAPI, the tokenizer)
have left some 300,000 objects that live as long as the process. Each full collection walks them all
(about 0.13 s on a 2-core host), and while it runs the event loop streams nothing. Collecting once and
freezing what survives (CPython's `gc.freeze`, made for servers that fork after startup) keeps them out
of every later collection; objects made while serving are collected as before.

Called only where a process is a server for the rest of its life (launch.py's `Deployment.run`, a router
actor): freezing in a test process would keep earlier tests' garbage alive for good."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collects, then freezes every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d startup objects out of the garbage collector's passes", frozen)
    return frozen
