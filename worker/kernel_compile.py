"""Compiling the Triton kernels for a GPU without one: a Triton driver that names the target and
launches nothing, so that a launcher called on CPU tensors compiles its kernel exactly as it would on that
GPU. A kernel that does not compile is then found on any machine, and each compiled kernel's registers,
spilled bytes and shared memory can be read (bench/kernel_resources.py) before a GPU is at hand."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CompiledLaunch:
    """One launch as compiled: the kernel, its compile-time arguments and launch options, and what a
    program of it holds on the target."""

    kernel: str
    constants: dict
    registers: int  # a thread's
    spilled_bytes: int  # a thread's stack: registers spilled to local memory
    shared_bytes: int  # a program's
    # launched with programmatic dependent launch, and then what some path of its code does before its first
    # wait on the kernel before: touches global memory, returns (neither is safe: worker/pdl_kernels.py)
    launch_pdl: bool = False
    memory_before_wait: int = 0
    returns_before_wait: int = 0
    # a program's barriers in its code (each a wait for all its warps; a reduction across warps takes one
    # or two): at batch 1 a kernel's time is mostly latency, and a chain of them is part of it
    barriers: int = 0


@dataclass
class Compiled:
    """What the launches inside `compile_only` compiled, in launch order."""

    launches: list[CompiledLaunch] = field(default_factory=list)

    def named(self, kernel: str) -> list[CompiledLaunch]:
        return [launch for launch in self.launches if launch.kernel == kernel]


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so that a launcher picks what it picks for a GPU (its tiles,
    its kernel over a torch fallback). Only its data pointer and dtype reach Triton."""

    @property
    def is_cuda(self) -> bool:
        return True


def on_gpu(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(OnGpu)


# the most shared memory a program may have on a GPU of this compute capability (cudaDevAttr
# MaxSharedMemoryPerBlockOptin); what Triton checks when it loads a kernel, which compile_only never does
MAX_SHARED_BYTES = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}


class _CompileOnlyDriver:
    """What Triton's JIT asks of the active driver before it compiles (the device, the stream, the
    target); the launch itself is skipped by `compile_only`. Its device is a key of its own, so that the
    kernels' per-device caches keep what it compiled apart from a real GPU's (and one target's from
    another's)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"compile-only-sm_{arch}"

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device: str | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_only(arch: int = 90) -> Iterator[Compiled]:
    """Every Triton launch inside compiles for sm_`arch` and runs nothing (the outputs stay as allocated).
    Needs Triton imported to compile (not TRITON_INTERPRET=1) and its bundled CUDA tools, no GPU."""
    import triton
    from triton.runtime import driver
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only needs Triton imported to compile: unset TRITON_INTERPRET")
    compiled = Compiled()
    launch = JITFunction.run

    limit = MAX_SHARED_BYTES[max(a for a in MAX_SHARED_BYTES if a <= arch)]  # the nearest at or below

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel.metadata.shared > limit:  # as a launch on that GPU fails (a launcher may fall back)
            raise OutOfResources(kernel.metadata.shared, limit, "shared memory")
        registers, spilled = _resource_usage(kernel.asm["cubin"], triton)
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        pdl = bool(getattr(kernel.metadata, "launch_pdl", False))
        early = before_wait(kernel.asm["ptx"]) if pdl else BeforeWait(0, 0)
        compiled.launches.append(
            CompiledLaunch(
                self.fn.__name__,
                constants,
                registers,
                spilled,
                int(kernel.metadata.shared),
                pdl,
                early.memory,
                early.returns,
                barriers(kernel.asm["ptx"]),
            )
        )
        return kernel

    before = driver._active  # reset_active() would build the default driver, which fails without a GPU
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = compile_instead
    # a launcher that picks its path by the GPU's compute capability picks what it picks on sm_`arch`
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: divmod(arch, 10)
    try:
        yield compiled
    finally:
        JITFunction.run = launch
        driver.set_active(before)
        torch.cuda.get_device_capability = capability


def _resource_usage(cubin: bytes, triton) -> tuple[int, int]:
    """(registers, stack bytes) of a thread, as cuobjdump (bundled with Triton) reads them from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return int(registers.group(1)) if registers else 0, int(stack.group(1)) if stack else 0


def barriers(ptx: str) -> int:
    """The barrier instructions in a kernel's PTX (each in a loop counted once)."""
    return len(re.findall(r"^\s*(?:@!?%\w+\s+)?(?:bar|barrier)\.(?:sync|red|arrive)\b", ptx, re.MULTILINE))


_LABEL = re.compile(r"^\s*(\$?[\w$.]+):\s*(?://.*)?$")
_INSTRUCTION = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s*([^;]*);")
# what touches memory the kernel before may write: loads, stores, atomics, copies from global memory
# (cp.async, TMA) and calls (what they do is not walked)
_MEMORY_OPS = {"ld", "ldu", "st", "atom", "red", "multimem", "tex", "suld", "sust"}
# state spaces a kernel's own launch owns: its parameters, its shared and local memory, constants
_OWN_SPACES = ("param", "shared", "local", "const")


@dataclass(frozen=True)
class BeforeWait:
    """What some path from a kernel's entry does before its first `griddepcontrol.wait`: instructions
    that may touch global memory (a load, a store, an atomic, a copy from global, a generic address, a call),
    and exits (an early return: then a later kernel's wait would not imply this one's predecessors)."""

    memory: int
    returns: int


def before_wait(ptx: str) -> BeforeWait:
    """Walks every path of the kernel's PTX from its entry to its first unpredicated wait."""
    lines = ptx[ptx.index(".entry") :].splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    seen: set[int] = set()
    memory: set[int] = set()
    returns: set[int] = set()
    todo = [0]
    while todo:
        i = todo.pop()
        while i < len(lines) and i not in seen:
            seen.add(i)
            m = _INSTRUCTION.match(lines[i])
            i += 1
            if m is None:
                continue
            predicated, opcode, operands = m.group(1) is not None, m.group(2), m.group(3)
            parts = opcode.split(".")
            if parts[0] == "griddepcontrol" and "wait" in parts and not predicated:
                break
            if (
                parts[0] == "call"
                or (parts[0] == "cp" and "global" in parts and "prefetch" not in parts)
                or (
                    parts[0] in _MEMORY_OPS
                    and ("global" in parts or not any(p.startswith(_OWN_SPACES) for p in parts[1:]))
                )
            ):
                memory.add(i - 1)
            if parts[0] in ("ret", "exit"):
                returns.add(i - 1)
                if not predicated:
                    break
            if parts[0] in ("bra", "brx"):
                todo.extend(labels[t] for t in re.findall(r"\$?[\w$.]+", operands) if t in labels)
                if not predicated:  # no fall-through
                    break
    return BeforeWait(len(memory), len(returns))
