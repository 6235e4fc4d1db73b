"""The command users run, and the files they configure it with."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from cluster.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in CONFIGS if not p.name.startswith("cluster-")], ids=lambda p: p.name)
def test_serving_configs_load_and_validate(path):
    config = ServeConfig.from_yaml(str(path)).override(model=ServeConfig.from_yaml(str(path)).model or "demo")
    config.validate()
    assert config.replica_config().tp_size == config.tp_size


# the `ray up` files (cluster-*.yaml): tests/test_cluster_files.py


def test_unknown_config_keys_are_named(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: x\ntp_sise: 2\n")
    with pytest.raises(ValueError, match="tp_sise"):
        ServeConfig.from_yaml(str(tmp_path / "bad.yaml"))


def test_a_setting_given_twice_in_a_config_file_is_named_with_its_line(tmp_path):
    import yaml

    (tmp_path / "twice.yaml").write_text("page_size: 16\ntp_size: 1\npage_size: 32\n")
    with pytest.raises(yaml.YAMLError, match="'page_size' is given twice") as e:
        ServeConfig.from_yaml(str(tmp_path / "twice.yaml"))
    assert "line 3" in str(e.value)


def test_a_number_written_with_an_exponent_and_no_dot_is_a_number_in_a_config_file(tmp_path):
    (tmp_path / "exp.yaml").write_text("model: x\ngpu_memory_utilization: 8e-1\n")  # a string to YAML 1.1
    assert ServeConfig.from_yaml(str(tmp_path / "exp.yaml")).override().engine.gpu_memory_utilization == 0.8


def test_help_with_a_value_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--help=1"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().endswith("--help takes no value"), done.stderr


# with the dashboard packages the demo is the README's quickstart, whose test checks what it prints of
# the dashboard (tests/test_readme.py); here, without them and stopped by SIGTERM
# to its process: as Ctrl-C's and a container's stop; to its group: as `timeout`, `kill -TERM -PGID` and
# systemd's default stop send it, ending the local Ray's processes beside it
@pytest.mark.parametrize("dashboard_packages,to_group", [(False, False), (False, True)], ids=["ray-minimal", "group"])
def test_demo_serves_and_stops_cleanly_on_sigterm(tmp_path, dashboard_packages, to_group):
    port = 18000 + os.getpid() % 1000 + (0 if dashboard_packages else 1) + (2 if to_group else 0)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    if not dashboard_packages:  # as on a host with Ray's minimal install: the dashboard cannot run
        hide = tmp_path / "hide"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text("import sys\nsys.modules['ray.dashboard.optional_deps'] = None\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "--demo",
            "random",
            "--port",
            str(port),
            "--config",
            str(ROOT / "configs" / "cpu-tiny.yaml"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=to_group,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the demo server did not come up"
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "demo", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stopped = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - stopped < 30, out  # not Ray's minute of waiting for its GCS
    finally:
        if proc.poll() is None:
            proc.kill()
    # uvicorn re-raises the signal after its graceful shutdown; Ray's handler then exits with 15
    assert proc.returncode in (0, signal.SIGTERM, -signal.SIGTERM), out
    assert "Traceback" not in out, out
    ready = re.search(rf"ready in ([0-9.]+) s: OpenAI-compatible API at http://127.0.0.1:{port}/v1", out)
    assert ready, out
    # where the start went: Ray, the replicas with the first one's engine by part, what is left
    parts = re.search(
        r"start-up: Ray ([0-9.]+) s, replicas ([0-9.]+) s \(replica 0's engine ([0-9.]+) s: weights [0-9.]+, "
        r"KV cache [0-9.]+, CUDA graphs [0-9.]+, warm-up [0-9.]+\)"
        r"(?:, router actors ([0-9.]+) s)?, the rest ([0-9.]+) s",
        out,
    )
    assert parts, out
    ray_s, replicas_s, engine_s, routers_s, rest_s = (float(x or 0) for x in parts.groups())
    assert engine_s <= replicas_s and ray_s + replicas_s + routers_s + rest_s == pytest.approx(
        float(ready.group(1)), abs=0.25
    )
    assert "draining" in out, out
    if dashboard_packages:
        assert "Ray dashboard: http" in out and "ray get-auth-token" in out, out
    else:
        assert "Ray dashboard off" in out and "ray[default]" in out, out


def test_a_replica_spans_two_nodes_with_pack_placement(tmp_path, qwen3_path):
    # its own Ray (two simulated one-CPU nodes), so in a separate process
    script = textwrap.dedent(f"""
        import ray
        from ray.cluster_utils import Cluster
        from cluster import SamplingParams
        from cluster.config import ReplicaConfig, SchedulerConfig
        from cluster.messages import AddRequest
        from cluster.fleet.deploy import ReplicaHandle
        from worker.config import EngineConfig
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1}})
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        config = ReplicaConfig(EngineConfig(model_path={str(qwen3_path)!r}, device="cpu"), SchedulerConfig(),
                               tp_size=2, placement_strategy="PACK")
        replica = ReplicaHandle(config)
        nodes = {{ray.get(replica.actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))}}
        nodes |= {{ray.get(f.node_and_pid.remote())[0] for f in replica.followers}}
        ray.get(replica.actor.submit.remote([AddRequest(0, [5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                                                     ignore_eos=True))]))
        got = []
        while not any(d.finished for d in got):
            got += ray.get(replica.actor.poll.remote(1.0))
        replica.shutdown()
        print("NODES", len(nodes), "TOKENS", len(got))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert "NODES 2 TOKENS 4" in out.stdout, out.stdout + out.stderr


def test_an_unreachable_hub_model_id_exits_with_what_to_do(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--model", "Qwen/Qwen3-0.6B"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--model cannot find 'Qwen/Qwen3-0.6B'" in out.stderr and "--local-dir" in out.stderr


def test_the_cache_is_under_xdg_cache_home_and_under_the_home_folder_when_it_is_unset_or_empty(monkeypatch, tmp_path):
    from worker.cache_home import cache_home

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "raylm"
    for unset in ("", None):  # empty means unset, as the XDG base directory specification says
        if unset is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert cache_home() == tmp_path / "home" / ".cache" / "raylm"


@pytest.mark.parametrize("text", ["{[a]: 1}\n", "? {b: 2}\n: 1\n"])
def test_a_key_that_is_a_list_or_a_mapping_in_a_config_file_is_named_with_its_line(tmp_path, text):
    import yaml

    (tmp_path / "keys.yaml").write_text(text)
    with pytest.raises(yaml.YAMLError, match="is not a setting's name") as e:
        ServeConfig.from_yaml(str(tmp_path / "keys.yaml"))
    assert "line 1" in str(e.value)
