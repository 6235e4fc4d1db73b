"""The shipped `ray up` files (configs/cluster-*.yaml) as Ray reads them: valid for Ray's own config
validation, GPU workers the autoscaler can add (each holding a replica of every serving config, and
enough of them for its most replicas), and setup commands that install torch from the index
for the nodes' CUDA and then this project from the one repository the user names, as README says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_FILES = sorted((ROOT / "configs").glob("cluster-*.yaml"))
SERVING_FILES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("cluster-"))
SOURCE = re.compile(r"^echo 'export (RAYLM_REPO=\S+ RAYLM_REF=\S+ RAYLM_TORCH_INDEX=\S+)' > ~/raylm.env$")


def _config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_are_cluster_files():
    assert [p.name for p in CLUSTER_FILES] == ["cluster-aws.yaml", "cluster-onprem.yaml"]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_ray_validates_the_cluster_file(path: Path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_config(path))  # defaults filled in as `ray up` fills them
    validate_config(prepared)  # raises on a field Ray does not know or a value of the wrong type
    for name, node_type in prepared["available_node_types"].items():
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= prepared["max_workers"], name


def test_the_cloud_file_has_gpu_workers_the_autoscaler_can_add():
    config = _config(ROOT / "configs/cluster-aws.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["max_workers"] == 0  # replicas go to the workers
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["resources"]["GPU"] >= 1 and t["max_workers"] > t["min_workers"] for t in workers)


@pytest.mark.parametrize("serving", SERVING_FILES, ids=lambda p: p.name)
def test_a_gpu_worker_holds_a_replica_of_each_serving_config_and_the_cloud_file_its_most_replicas(serving: Path):
    from cluster.config import ServeConfig
    from cluster.fleet.deploy import replica_bundles

    config = ServeConfig.from_yaml(str(serving))
    cloud = _config(ROOT / "configs/cluster-aws.yaml")
    workers = [t for name, t in cloud["available_node_types"].items() if name != cloud["head_node_type"]]
    bundles = replica_bundles(config.tp_size, gpu=True)  # a replica's placement group, as deploy.py asks it
    need = {key: sum(b[key] for b in bundles) for key in bundles[0]}
    # STRICT_PACK: all of a replica's ranks on one node, so a node the autoscaler adds must hold them
    fits = [t for t in workers if all(t["resources"].get(key, 0) >= n for key, n in need.items())]
    assert fits, (serving.name, need)
    most = config.replica_range[1] if config.autoscaling else config.replicas
    gpus = sum(t["max_workers"] * t["resources"]["GPU"] for t in fits)
    assert gpus >= most * config.tp_size, (serving.name, gpus)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_the_setup_commands_name_the_source_in_one_line(path: Path):
    commands = _config(path)["setup_commands"]
    assert SOURCE.match(commands[0]), commands[0]
    rest = "\n".join(commands[1:])
    assert "https://" not in rest and "git clone" in rest  # no second place that names a source
    torch = next(c for c in commands if "pip install" in c and "torch" in c)
    project = next(c for c in commands if 'pip install -e ".[gpu]"' in c)
    assert commands.index(torch) < commands.index(project)  # the CUDA build first: the project's install keeps it
    assert '--index-url "$RAYLM_TORCH_INDEX"' in torch
    pyproject = (ROOT / "pyproject.toml").read_text()
    wanted = re.search(r'"(torch[^"]*)"', pyproject).group(1)
    assert f'pip install "{wanted}"' in torch  # the versions the project accepts, so pip installs none other


def test_the_setup_commands_install_the_project_from_the_named_repository(tmp_path: Path):
    """Run as `ray up` runs them (each in its own shell, in the home folder), with the named repository
    this checkout and `pip` a stand-in that records what it is asked to install."""
    home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "pip.log"
    home.mkdir()
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "$(pwd) $*" >> {log}\n')
    (bin_dir / "pip").chmod(0o755)
    commands = _config(ROOT / "configs/cluster-aws.yaml")["setup_commands"]
    env_line = re.sub(r"RAYLM_REPO=\S+", f"RAYLM_REPO={ROOT}", commands[0]).replace("RAYLM_REF=main", "RAYLM_REF=HEAD")
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1"}
    for command in [env_line, *commands[1:]]:
        done = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert (
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=home / "raylm", capture_output=True, text=True).stdout == head
    )
    assert (home / "raylm/launch.py").exists()  # README's `cd raylm && python launch.py ...` finds it
    installs = log.read_text().splitlines()
    assert installs[0].startswith(f"{home} install torch") and "https://download.pytorch.org/whl/cu128" in installs[0]
    assert installs[1] == f"{home}/raylm install -e .[gpu]"


def test_an_unedited_source_line_stops_the_setup_with_what_to_edit(tmp_path: Path):
    commands = _config(ROOT / "configs/cluster-aws.yaml")["setup_commands"]
    script = " && ".join(f"({c})" for c in commands[:2])
    done = subprocess.run(["bash", "-c", script], env={"HOME": str(tmp_path)}, capture_output=True, text=True)
    assert done.returncode != 0 and "set RAYLM_REPO" in done.stderr


def test_readme_commands_run_where_the_setup_commands_put_the_project():
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Deploy on a Ray cluster\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    assert "RAYLM_REPO" in section and "RAYLM_TORCH_INDEX" in section  # README says what to edit
    assert 'ray exec configs/cluster-aws.yaml "cd raylm && ' in section
