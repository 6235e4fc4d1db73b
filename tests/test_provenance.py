"""`worker`, `cluster` and `router` are common package names: a package of one of those names from another
distribution, first on sys.path, is refused at import with an error that says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_with_foreign(tmp_path: Path, foreign: str, imported: str) -> subprocess.CompletedProcess:
    (tmp_path / "site" / foreign).mkdir(parents=True)
    (tmp_path / "site" / foreign / "__init__.py").write_text("")
    # the project's folder first, so `imported` is this project's and only `foreign` comes from elsewhere
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}]; sys.modules.pop({foreign!r}, None); "
        f"sys.path.insert(0, {str(tmp_path / 'site')!r}) if {foreign!r} != {imported!r} else None; "
        f"import {imported}"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.parametrize("foreign", ["worker", "router"])
def test_cluster_refuses_a_foreign_package_beside_it(tmp_path, foreign):
    done = import_with_foreign(tmp_path, foreign, "cluster")
    assert done.returncode != 0
    assert "ForeignPackageError" in done.stderr and f"the package {foreign!r}" in done.stderr
    assert "virtual environment" in done.stderr


def test_router_refuses_a_foreign_cluster(tmp_path):
    done = import_with_foreign(tmp_path, "cluster", "router")
    assert done.returncode != 0
    assert "the package 'cluster' that Python imports" in done.stderr


def test_the_projects_own_packages_import():
    done = subprocess.run(
        [sys.executable, "-c", "import router, cluster, worker"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
