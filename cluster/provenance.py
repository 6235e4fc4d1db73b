"""A start-up check that `worker`, `cluster` and `router` are this project's packages: the names are
common ones, another distribution installed beside this one may ship a package of the same name, and
whichever comes first on sys.path is the one imported, which would fail far from the cause."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGES = ("worker", "cluster", "router")
HOME = Path(__file__).resolve().parent.parent  # this project's three packages sit side by side here


class ForeignPackageError(ImportError):
    pass


def foreign_package(name: str, home: Path = HOME) -> Path | None:
    """Where the package `name` that Python would import lives, when that is not beside this one."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or spec.origin in ("namespace", "built-in"):
        return None
    where = Path(spec.origin).resolve().parent
    return None if where.parent == home else where


def check_own_packages(home: Path = HOME) -> None:
    for name in PACKAGES:
        where = foreign_package(name, home)
        if where is not None:
            raise ForeignPackageError(
                f"the package {name!r} that Python imports, at {where}, is not raylm's ({home / name}): another "
                f"installed distribution ships a top-level {name!r} package and comes first on sys.path; "
                f"uninstall it (`pip show -f` names its owner) or install raylm in a virtual environment of its own"
            )
