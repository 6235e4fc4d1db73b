"""Where the project keeps what it makes once and reuses (the demo model, folders made from GGUF files,
linear-layer timings): $XDG_CACHE_HOME/raylm, or ~/.cache/raylm where that is unset or empty, as the XDG
base directory specification has it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """The folder; RuntimeError where there is no home folder either (a container's arbitrary uid)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "raylm"
