"""FlashInfer's modules built before an engine starts, so that its first start compiles none.

FlashInfer compiles each attention, norm and activation module the first time an engine loads it (one to
several minutes on a fresh host). This builds the ones an engine of a given model will load, on any host
with CUDA's compiler and headers (no GPU needed: name the GPU's architecture), and installs them where
FlashInfer loads a module as it is, without a build step: its AOT folder, or a folder of your own to copy
onto other hosts (into `flashinfer/data/aot/` of their installed package).

    python -m worker.kernel_prebuild --model PATH [--kv-cache-dtype fp8_e4m3] [--cuda-arch 9.0a] [--into DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.attention.flashinfer_backend import fa3_builds
from worker.checkpoint_error import CheckpointError

if TYPE_CHECKING:
    from flashinfer.jit.core import JitSpec

HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class ModuleWant:
    """One FlashInfer module an engine loads: its generator's name and arguments (dtypes by name)."""

    kind: str  # norm, rope, silu_and_mul, decode, prefill
    q_dtype: str = ""
    kv_dtype: str = ""
    head_dim: int = 0
    backend: str = ""  # prefill: fa2 or fa3


def wanted_modules(head_dim: int, q_dtype: str, kv_dtype: str, major: int) -> list[ModuleWant]:
    """What an engine with FlashInfer attention loads on a GPU of compute capability `major`.x: the fused
    norm, rotary and SiLU-and-multiply kernels, the CUDA-core decode kernel, FA2's prefill (extend steps
    off Hopper, and the tensor-core decode path and a mixed step's decode rows everywhere) and, where it
    builds, FA3's (extend steps on Hopper; worker/attention/flashinfer_backend.py prefill_backend)."""
    wants = [ModuleWant("norm"), ModuleWant("rope"), ModuleWant("silu_and_mul")]
    wants.append(ModuleWant("decode", q_dtype, kv_dtype, head_dim))
    wants.append(ModuleWant("prefill", q_dtype, kv_dtype, head_dim, "fa2"))
    if fa3_builds(major, head_dim, getattr(torch, kv_dtype)):
        wants.append(ModuleWant("prefill", q_dtype, kv_dtype, head_dim, "fa3"))
    return wants


def jit_spec(want: ModuleWant) -> JitSpec:
    """FlashInfer's JitSpec of a module, with the arguments its wrappers plan with (an int32 page index,
    no positional encoding in the kernel, no sliding window, no logit cap, no fp16 q.k reduction)."""
    from flashinfer.jit import activation, attention, norm, rope

    if want.kind == "norm":
        return norm.gen_norm_module()
    if want.kind == "rope":
        return rope.gen_rope_module()
    if want.kind == "silu_and_mul":
        return activation.gen_act_and_mul_module("silu")
    q, kv = getattr(torch, want.q_dtype), getattr(torch, want.kv_dtype)
    common = (q, kv, q, torch.int32, want.head_dim, want.head_dim, 0, False, False)
    if want.kind == "decode":
        return attention.gen_batch_decode_module(*common)
    return attention.gen_batch_prefill_module(want.backend, *common, False)


def prebuild(wants: list[ModuleWant], into: Path | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """Builds each module (one build at a time on this host: worker/kernel_builds.py) and copies its
    library into `into`/<name>/<name>.so, FlashInfer's AOT layout (None: FlashInfer's own AOT folder).
    A module already there is left as it is, whatever architectures it was built for. Returns the
    libraries installed."""
    from flashinfer.jit import env

    from worker.kernel_builds import serialize_flashinfer_builds

    serialize_flashinfer_builds()
    dest_root = into or Path(env.FLASHINFER_AOT_DIR)
    installed = []
    for want in wants:
        spec = jit_spec(want)
        dest = dest_root / spec.name / f"{spec.name}.so"
        if dest.exists():
            log(f"present  {spec.name}")
            continue
        start = time.perf_counter()
        spec.build(verbose=False)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
        installed.append(dest)
        log(f"built    {spec.name} in {time.perf_counter() - start:.0f} s")
    return installed


def model_wants(model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", major: int = 9) -> list[ModuleWant]:
    """wanted_modules for an engine serving the model folder with these settings, its dtype resolved as the
    engine resolves it on a GPU (auto: the checkpoint's, bfloat16 where it names none)."""
    from worker.engine import load_hf_config, resolve_dtype
    from worker.models.llama import head_dim_of

    config = load_hf_config(model)
    q_dtype = str(resolve_dtype(dtype, config, torch.device("cuda"))).removeprefix("torch.")
    if q_dtype not in HALF_DTYPES:
        raise ValueError(f"FlashInfer attention runs in {' or '.join(HALF_DTYPES)}, not {q_dtype}")
    kv_dtype = {"auto": q_dtype, "fp8_e4m3": "float8_e4m3fn"}[kv_cache_dtype]
    return wanted_modules(head_dim_of(config), q_dtype, kv_dtype, major)


def arch_majors(arch_list: str) -> list[int]:
    """The major compute capabilities of a FLASHINFER_CUDA_ARCH_LIST value ("8.0 9.0a": [8, 9]); [] when an
    entry is not MAJOR.MINOR."""
    majors = []
    for entry in arch_list.split():
        major, dot, minor = entry.partition(".")
        if not (major.isdigit() and dot and minor[:1].isdigit()):
            return []
        majors.append(int(major))
    return majors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model folder the engine will serve (its config.json)")
    p.add_argument("--dtype", choices=["auto", *HALF_DTYPES], default="auto", help="the engine's dtype setting")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    p.add_argument(
        "--cuda-arch",
        help="the GPU's compute capability, e.g. 9.0a for an H100 or H200 (default: this host's GPU)",
    )
    p.add_argument("--into", type=Path, help="a folder of your own instead of FlashInfer's AOT folder")
    args = p.parse_args()
    if importlib.util.find_spec("flashinfer") is None:
        p.error("FlashInfer is not installed here: pip install -e '.[gpu]' (the version the GPU hosts run)")
    if args.cuda_arch:  # read by FlashInfer at its import: set before it
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.cuda_arch
    arch = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if arch:
        majors = arch_majors(arch)
        if not majors:
            p.error(
                f"--cuda-arch (FLASHINFER_CUDA_ARCH_LIST) {arch!r}: "
                "give compute capabilities such as 9.0a or '8.0 9.0a'"
            )
    else:
        if not torch.cuda.is_available():
            p.error("no GPU here: name the one the engine will run on with --cuda-arch (e.g. 9.0a)")
        majors = [torch.cuda.get_device_capability()[0]]
    try:  # every architecture's modules (FA3 where one of them is Hopper)
        wants = list(
            dict.fromkeys(w for m in majors for w in model_wants(args.model, args.dtype, args.kv_cache_dtype, m))
        )
    except (CheckpointError, ValueError) as e:
        p.error(str(e))
    installed = prebuild(wants, args.into)
    print(f"{len(installed)} module(s) built, {len(wants) - len(installed)} already there")


if __name__ == "__main__":
    main()
