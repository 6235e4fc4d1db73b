"""README's quickstart, run as written: its code blocks are read from README.md (not copied here), so
the README cannot drift from what works."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block in README's Quickstart section, in order."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no Quickstart section"
    return re.findall(r"^```(\w+)\n(.*?)^```", section.group(1), re.S | re.M)


def test_the_quickstart_runs_as_written(tmp_path):
    blocks = quickstart_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python"], blocks
    serve, install, client = (code.strip() for _, code in blocks)
    assert serve.startswith("python launch.py") and "\n" not in serve
    # the user's cache, as the quickstart's: the real demo model is fetched once, not once a run
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable if word == "python" else word for word in shlex.split(serve)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240  # a first run fetches the model
        while True:  # the client block's URL
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the quickstart server did not come up"
            time.sleep(0.5)
        for line in install.splitlines():
            done = subprocess.run(
                line.replace("pip", f"{sys.executable} -m pip", 1),
                shell=True,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        ran = subprocess.run(
            [sys.executable, "-c", client], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert ran.stdout.endswith("\n") and "Traceback" not in ran.stderr
        assert "Paris" in ran.stdout, ran.stdout  # the demo answers
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as the README says
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "http://127.0.0.1:8000/v1" in out and "Traceback" not in out, out
    # with Ray's dashboard packages (this suite's install): where the dashboard is, and how to log in
    assert "Ray dashboard: http" in out and "ray get-auth-token" in out, out
