"""FlashInfer's kernel builds run one at a time on a host (worker/kernel_builds.py), checked on a stand-in
for flashinfer.jit.core: two engines' builds at once would lose each other's entries in ninja's shared log."""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

from worker.kernel_builds import LOCK_NAME, serialize_builds


def fake_core(tmp_path: Path, builds: list[str], inside: dict[str, threading.Event], leave: dict[str, threading.Event]):
    core = ModuleType("fake_flashinfer_jit_core")

    class JitSpec:
        def __init__(self, name: str) -> None:
            self.name = name

        def build(self, verbose: bool, need_lock: bool = True) -> None:
            builds.append(self.name)
            inside[self.name].set()
            assert leave[self.name].wait(30)

    core.JitSpec = JitSpec
    core.get_tmpdir = lambda: tmp_path
    return core


def test_a_second_build_waits_until_the_first_is_done(tmp_path):
    names = ("decode", "prefill")
    builds: list[str] = []
    inside = {n: threading.Event() for n in names}
    leave = {n: threading.Event() for n in names}
    core = fake_core(tmp_path, builds, inside, leave)
    assert serialize_builds(core)
    threads = {n: threading.Thread(target=core.JitSpec(n).build, args=(False,)) for n in names}
    threads["decode"].start()
    assert inside["decode"].wait(30)
    threads["prefill"].start()
    # the second build is blocked on the host's lock while the first holds it
    assert not inside["prefill"].wait(1.0)
    assert builds == ["decode"]
    leave["decode"].set()
    assert inside["prefill"].wait(30)
    leave["prefill"].set()
    for t in threads.values():
        t.join(30)
    assert builds == ["decode", "prefill"]
    assert (tmp_path / LOCK_NAME).exists()


def test_wrapping_twice_wraps_once(tmp_path):
    core = fake_core(tmp_path, [], {}, {})
    original = core.JitSpec.build
    assert serialize_builds(core) and serialize_builds(core)
    assert core.JitSpec.build.__wrapped__ is original


def test_a_flashinfer_without_what_it_wraps_is_left_alone():
    core = ModuleType("other_flashinfer")
    assert not serialize_builds(core)
