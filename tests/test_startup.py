"""What a new user sees when start-up cannot work: one line saying what is wrong and what to change,
a non-zero exit, within seconds when Ray is not needed to know, and nothing left running."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, cwd: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def broken_copy(qwen3_path: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the tiny checkpoint, damaged as `name` says."""
    folder = tmp_path / name
    if name == "empty":
        folder.mkdir()
        return folder
    shutil.copytree(qwen3_path, folder)
    if name == "unknown-architecture":
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = ["MambaForCausalLM"]
        (folder / "config.json").write_text(json.dumps(config))
    elif name == "truncated-weights":
        weights = folder / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif name == "no-weights":
        (folder / "model.safetensors").unlink()
    elif name == "no-tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).unlink(missing_ok=True)
    elif name == "tokenizer-config-alone":  # the file that configures a tokenizer, not the one that makes it
        (folder / "tokenizer.json").unlink()
    elif name == "bad-config-json":
        (folder / "config.json").write_text("{not json")
    elif name == "config-json-a-list":
        (folder / "config.json").write_text("[1, 2]")
    elif name == "no-kv-heads":
        config = json.loads((folder / "config.json").read_text())
        config["num_key_value_heads"] = 0
        (folder / "config.json").write_text(json.dumps(config))
    elif name == "architectures-a-string":
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = config["architectures"][0]
        (folder / "config.json").write_text(json.dumps(config))
    elif name == "heads-a-string":
        config = json.loads((folder / "config.json").read_text())
        config["num_attention_heads"] = "4"
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "name,says",
    [
        ("missing", "there is no file or folder"),
        ("empty", "has no config.json"),
        ("bad-config-json", "cannot be read as JSON"),
        ("config-json-a-list", "its config.json is no JSON object but a list"),
        ("no-kv-heads", "its config.json's num_key_value_heads is 0, not a positive integer"),
        ("heads-a-string", "its config.json's num_attention_heads is '4', not a positive integer"),
        ("unknown-architecture", "MambaForCausalLM, which this server does not run; it runs"),
        ("architectures-a-string", '"architectures" is a list of names: write ["Qwen3ForCausalLM"]'),
        ("truncated-weights", "not a whole safetensors file"),
        ("no-weights", "has no *.safetensors weights"),
        ("no-tokenizer", "has no tokenizer files"),
        ("tokenizer-config-alone", "has no tokenizer files (tokenizer.json or"),
    ],
)
def test_a_model_folder_that_cannot_serve_is_named_in_one_line(qwen3_path, tmp_path, name, says):
    model = tmp_path / "nowhere" / "model" if name == "missing" else broken_copy(qwen3_path, tmp_path, name)
    code, out, elapsed = launch("--model", str(model), cwd=tmp_path)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1, out
    assert says in lines[0] and "--model" in lines[0], out
    assert "Traceback" not in out and "huggingface" not in out.lower() and "AttributeError" not in out
    assert elapsed < 20, "known before Ray starts"


def test_a_port_in_use_is_named_before_anything_starts(qwen3_path, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, elapsed = launch("--model", str(qwen3_path), "--port", str(port), cwd=tmp_path)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"127.0.0.1:{port}" in out and "--port" in out and "OpenAI-compatible API" not in out
    assert "Ray" not in out and elapsed < 20, out


def _one_line(code: int, out: str, elapsed: float) -> str:
    """The one error line of a start that failed before Ray started."""
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out, out
    assert elapsed < 20, "known before Ray starts"
    return lines[0]


def test_a_host_that_is_no_address_of_this_machine_is_named_not_the_port(qwen3_path, tmp_path):
    line = _one_line(*launch("--model", str(qwen3_path), "--host", "256.1.1.1", cwd=tmp_path))
    assert "--host 256.1.1.1" in line and "--port" not in line


def test_a_taken_metrics_export_port_is_named_before_ray_starts(qwen3_path, tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line(*launch("--model", str(qwen3_path), "--metrics-export-port", str(port), cwd=tmp_path))
    assert "--metrics-export-port" in line and str(port) in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the error is for a machine without a GPU")
def test_a_cuda_device_on_a_machine_without_gpus_is_named_not_waited_for(qwen3_path, tmp_path):
    line = _one_line(*launch("--model", str(qwen3_path), "--device", "cuda", cwd=tmp_path))
    assert "--device cuda" in line and "no GPU" in line


def test_demo_and_a_model_together_are_refused(qwen3_path, tmp_path):
    line = _one_line(*launch("--demo", "random", "--model", str(qwen3_path), cwd=tmp_path))
    assert "--model" in line and "--demo" in line


def test_a_model_path_under_home_is_expanded(qwen3_path, tmp_path):
    shutil.copytree(qwen3_path, tmp_path / "home" / "model")
    with socket.socket() as taken:  # the start then stops at the port, past the model's check
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "--model", "~/model", "--port", port],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1"),
        )
    assert done.returncode == 2 and "--port" in done.stderr and "--model" not in done.stderr, done.stderr


def test_a_config_file_that_is_not_utf8_is_named(qwen3_path, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe bad")
    line = _one_line(*launch("--config", str(bad), "--model", str(qwen3_path), cwd=tmp_path))
    assert f"--config {bad}: cannot read it" in line


def test_a_hub_id_still_goes_to_the_hub(tmp_path):
    from launch import looks_like_hub_id

    assert looks_like_hub_id("Qwen/Qwen3-0.6B")
    assert not any(looks_like_hub_id(p) for p in ("/models/Qwen3-8B", "./model", "~/m/x", "a/b/c", "model"))


def test_joining_a_cluster_that_wants_a_token_says_how(monkeypatch):
    from cluster.fleet import deploy

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    class AuthenticationError(Exception):
        pass

    class RefusingGcs:
        def __init__(self, address):
            pass

        def internal_kv_get(self, *args, **kwargs):
            raise AuthenticationError("RPC error: InvalidAuthToken")

    monkeypatch.setattr("ray._raylet.GcsClient", RefusingGcs)
    with pytest.raises(deploy.ClusterAuthError, match="RAY_AUTH_MODE=token"):
        deploy.check_cluster_auth("127.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    deploy.check_cluster_auth("127.0.0.1:6379")  # the user chose: nothing to say
