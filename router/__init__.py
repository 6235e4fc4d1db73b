"""HTTP frontend: the OpenAI-compatible API, tokenization and detokenization, routing over replicas."""

import importlib.util as _util
from pathlib import Path as _Path

# cluster checks worker and router once imported (cluster/provenance.py); whether `cluster` itself is this
# project's is checked here, without importing it
_home = _Path(__file__).resolve().parent.parent
_spec = _util.find_spec("cluster")
if _spec is not None and _spec.origin and _Path(_spec.origin).resolve().parent.parent != _home:
    raise ImportError(
        f"the package 'cluster' that Python imports, at {_Path(_spec.origin).parent}, is not raylm's "
        f"({_home / 'cluster'}): another installed distribution ships a top-level 'cluster' package; "
        "uninstall it (`pip show -f` names its owner) or install raylm in a virtual environment of its own"
    )
