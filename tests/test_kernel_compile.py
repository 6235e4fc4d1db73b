"""Every Triton kernel compiles for an H200 (sm_90) on a machine without a GPU, through the launchers at the
shapes the engine's steps give them (bench/kernel_resources.py on the tiny architectures, in a process of
its own: this one imported Triton to interpret). A kernel that would fail to compile on the GPU fails here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = (
    "worker.triton_kernels",
    "worker.gemv_kernels",
    "worker.triton_decode",
    "worker.layers.moe.triton_kernels",
    "worker.quant.fp8_kernels",
)


def kernels_defined() -> set[str]:
    """The Triton kernels the modules define (their jitted helpers, called from kernels, are not launched)."""
    names = set()
    for module in map(importlib.import_module, KERNEL_MODULES):
        names |= {name for name, obj in vars(module).items() if name.endswith("_kernel") and hasattr(obj, "fn")}
    return names


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "launches.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--arch", "tiny", "tiny-moe", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_launch_compiles_for_sm90(report):
    assert report["failed"] == []
    assert report["launches"]
    assert all(launch["registers"] > 0 for launch in report["launches"])


def test_every_kernel_the_engine_defines_is_compiled(report):
    defined = kernels_defined()
    assert "_split_kernel" in defined and "moe_row_down_kernel" in defined
    assert defined - {launch["kernel"] for launch in report["launches"]} == set()


def test_the_decode_kernels_variants_compile_over_an_fp8_cache(report):
    decode = [launch["launch"] for launch in report["launches"] if launch["kernel"] == "_split_kernel"]
    for variant in (", cuda_cores", ", prefetch", ", no prefetch", ", convert_v", ", no convert_v"):
        assert any(where.endswith(variant) and "fp8 cache" in where for where in decode), variant


def test_batch_1s_kernels_launched_with_pdl_wait_before_they_touch_memory(report):
    pdl = [launch for launch in report["launches"] if launch["launch"].endswith(", pdl")]
    kernels = {launch["kernel"] for launch in pdl}
    assert {"norm_linear_kernel", "small_linear_kernel", "_split_kernel", "moe_row_down_kernel"} <= kernels
    assert {"fp8_gemv_kernel", "silu_linear_kernel", "sample_reduce_kernel", "qkv_prologue_kernel"} <= kernels
    assert all(launch["launch_pdl"] for launch in pdl)
    assert [launch["kernel"] for launch in pdl if launch["memory_before_wait"] or launch["returns_before_wait"]] == []
    assert not any(launch["launch_pdl"] for launch in report["launches"] if launch not in pdl)


# a kernel whose tiles fit an sm_80 at 64 and no GPU at 256: run in a process of its own (see above)
OVERSIZED = """
import torch, triton, triton.language as tl
from triton.runtime.errors import OutOfResources
from worker.kernel_compile import compile_only, on_gpu

@triton.jit
def product(a, b, c, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(a + offs[:, None] * N + offs[None, :])
    y = tl.load(b + offs[:, None] * N + offs[None, :])
    tl.store(c + offs[:, None] * N + offs[None, :], tl.dot(x, y))

def launch(n):
    x = on_gpu(torch.empty(n, n, dtype=torch.bfloat16))
    product[(1,)](x, x, on_gpu(torch.empty(n, n)), N=n)

with compile_only(90) as hopper:
    launch(64)
with compile_only(80) as ampere:
    launch(64)
try:
    with compile_only(90):
        launch(256)
except OutOfResources:
    print("refused", hopper.launches[0].shared_bytes > 0, len(ampere.launches))
"""


def compiled_in_a_process(tmp_path, source: str) -> subprocess.CompletedProcess:
    """Runs `source` in a process of its own, where Triton compiles (this one imported it to interpret)."""
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)


def test_a_kernel_past_the_gpus_shared_memory_fails_as_its_launch_would(tmp_path):
    run = compiled_in_a_process(tmp_path, OVERSIZED)
    assert run.stdout.split() == ["refused", "True", "1"], run.stdout + run.stderr[-3000:]


# a kernel launched with programmatic dependent launch that reads its input before its wait, on one of two
# paths, beside one that waits first: the compile check counts the first's early read, not the second's
EARLY_READ = """
import torch, triton, triton.language as tl
from worker.kernel_compile import compile_only, on_gpu

@triton.jit
def copy(src, dst, n, EARLY: tl.constexpr):
    offs = tl.arange(0, 64)
    if EARLY == 1:  # a read before the wait on one of two paths
        if n > 64:
            x = tl.load(src + offs)
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            x = tl.load(src + offs)
    elif EARLY == 2:  # some programs leave before the wait
        if tl.program_id(0) >= n:
            return
        tl.extra.cuda.gdc_wait()
        x = tl.load(src + offs)
    else:
        tl.extra.cuda.gdc_wait()
        x = tl.load(src + offs)
    tl.store(dst + offs, x)

x = on_gpu(torch.empty(64))
with compile_only(90) as compiled:
    for early in (1, 2, 0):
        copy[(1,)](x, x, 64, EARLY=early, launch_pdl=True)
print(*(f"{launch.memory_before_wait}/{launch.returns_before_wait}" for launch in compiled.launches))
"""


def test_the_compile_check_finds_a_read_or_a_return_before_the_wait_on_any_path(tmp_path):
    run = compiled_in_a_process(tmp_path, EARLY_READ)
    assert run.stdout.split() == ["1/0", "0/1", "0/0"], run.stdout + run.stderr[-3000:]
