"""FlashInfer's modules built ahead of an engine's start (worker/kernel_prebuild.py): the modules chosen
are those the engine loads, and each built library lands in FlashInfer's AOT layout, once. FlashInfer
itself is a stand-in here (CI has no CUDA compiler); the build has run for real on a CPU-only host with
nvcc 13.0, and its libraries served an H200 (docs/BENCHMARKS.md, "Prefill-heavy work, 2026-12-03")."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from worker import kernel_prebuild
from worker.attention.flashinfer_backend import prefill_backend
from worker.kernel_prebuild import ModuleWant, prebuild, wanted_modules


def kinds(wants: list[ModuleWant]) -> list[tuple[str, str, str]]:
    return [(w.kind, w.kv_dtype, w.backend) for w in wants]


def test_on_hopper_over_a_half_precision_cache_both_prefills_are_built():
    wants = wanted_modules(128, "bfloat16", "bfloat16", major=9)
    assert kinds(wants) == [
        ("norm", "", ""),
        ("rope", "", ""),
        ("silu_and_mul", "", ""),
        ("decode", "bfloat16", ""),
        ("prefill", "bfloat16", "fa2"),
        ("prefill", "bfloat16", "fa3"),
    ]
    assert {w.head_dim for w in wants if w.kind in ("decode", "prefill")} == {128}


@pytest.mark.parametrize(
    "head_dim,kv_dtype,major", [(128, "float8_e4m3fn", 9), (128, "bfloat16", 8), (96, "bfloat16", 9)]
)
def test_fa3_is_left_out_where_the_engine_does_not_run_it(head_dim, kv_dtype, major):
    wants = wanted_modules(head_dim, "bfloat16", kv_dtype, major)
    assert [w.backend for w in wants if w.kind == "prefill"] == ["fa2"]
    assert [w.kv_dtype for w in wants if w.kind == "decode"] == [kv_dtype]


def test_a_models_dtype_and_head_size_pick_the_modules(tmp_path):
    from transformers import Qwen3Config

    def folder(name: str, **kw) -> str:
        Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **kw).save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    def decodes(wants: list[ModuleWant]) -> set[tuple[str, str, int]]:
        return {(w.q_dtype, w.kv_dtype, w.head_dim) for w in wants if w.kind == "decode"}

    unnamed, half = folder("unnamed", head_dim=128), folder("half", head_dim=64, dtype="float16")
    assert decodes(kernel_prebuild.model_wants(unnamed, kv_cache_dtype="fp8_e4m3")) == {
        ("bfloat16", "float8_e4m3fn", 128)
    }
    assert decodes(kernel_prebuild.model_wants(half)) == {("float16", "float16", 64)}  # the checkpoint's dtype
    assert decodes(kernel_prebuild.model_wants(half, dtype="bfloat16")) == {("bfloat16", "bfloat16", 64)}


def test_architecture_lists_read_as_flashinfer_reads_them():
    assert kernel_prebuild.arch_majors("9.0a") == [9]
    assert kernel_prebuild.arch_majors("8.0 9.0a") == [8, 9]
    assert kernel_prebuild.arch_majors("sm_90a") == kernel_prebuild.arch_majors("90a") == []


def test_the_engine_off_hopper_takes_fa2_as_the_prebuild_does():
    assert prefill_backend(torch.device("cpu"), 128, torch.bfloat16) == "fa2"


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch):
    """flashinfer.jit with an AOT folder under tmp_path and specs whose build writes a library."""
    aot, built = tmp_path / "aot", []
    env = ModuleType("flashinfer.jit.env")
    env.FLASHINFER_AOT_DIR = aot
    jit = ModuleType("flashinfer.jit")
    jit.env = env
    package = ModuleType("flashinfer")
    package.jit = jit
    for name, module in (("flashinfer", package), ("flashinfer.jit", jit), ("flashinfer.jit.env", env)):
        monkeypatch.setitem(sys.modules, name, module)

    def spec_of(want: ModuleWant):
        name = f"{want.kind}_{want.kv_dtype}_{want.backend}".rstrip("_")
        library = tmp_path / "jit" / name / f"{name}.so"

        def build(verbose: bool) -> None:
            library.parent.mkdir(parents=True, exist_ok=True)
            library.write_bytes(name.encode())
            built.append(name)

        return SimpleNamespace(name=name, build=build, jit_library_path=library)

    monkeypatch.setattr(kernel_prebuild, "jit_spec", spec_of)
    return SimpleNamespace(aot=aot, built=built)


def test_each_library_lands_in_flashinfers_aot_layout_once(fake_flashinfer, tmp_path):
    wants = wanted_modules(128, "bfloat16", "bfloat16", major=9)
    installed = prebuild(wants, log=lambda _: None)
    assert len(installed) == len(wants) == len(fake_flashinfer.built)
    for path in installed:
        assert path.parent.parent == fake_flashinfer.aot and path.name == f"{path.parent.name}.so"
        assert path.read_bytes() == path.parent.name.encode()
    assert prebuild(wants, log=lambda _: None) == []  # present: nothing built again
    assert len(fake_flashinfer.built) == len(wants)


def test_a_folder_of_ones_own_takes_the_libraries_instead(fake_flashinfer, tmp_path):
    into = tmp_path / "ship"
    installed = prebuild(wanted_modules(64, "float16", "float16", major=8), into=into, log=lambda _: None)
    assert installed and all(Path(p).is_relative_to(into) for p in installed)
    assert not fake_flashinfer.aot.exists()
