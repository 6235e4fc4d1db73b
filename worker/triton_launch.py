"""Launching a Triton kernel without Triton's work per launch: binding the arguments, specializing each
one and looking the variant up, about 80 us a launch on the GPU hosts' CPUs (cProfile, bench/host_profile.py),
against about 20 for the launch itself. An eager prompt step launches the attention prologue once a layer,
so those microseconds add up on TTFT's path, where the host's launches, not the GPU, set the pace.

`CachedLaunch` launches through Triton once for each class of arguments Triton would compile apart (each
tensor's dtype and 16-byte alignment; each integer's type and whether it is 1 or a multiple of 16; each
constexpr's value; the warps), keeps the compiled variant it returns, and launches that directly from then
on, with the arguments in the kernel's order and Triton's launch hooks, as Triton's own launch passes them
(Triton 3.4 and later; earlier versions, the CPU interpreter and a kernel with pre-run hooks go through
Triton every time)."""

from __future__ import annotations

from typing import Any

import torch

try:
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # Triton before 3.4 (no knobs), or none
    knobs = None


class CachedLaunch:
    def __init__(self, kernel) -> None:
        """`kernel`: a @triton.jit function, called with every argument positionally, in its order."""
        self.kernel = kernel
        # the CPU interpreter's functions have no parameters to read: they are launched as they are
        self.constexpr = tuple(p.is_constexpr for p in kernel.params) if hasattr(kernel, "params") else None
        self.variants: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, num_warps: int) -> None:
        if self.constexpr is not None and len(args) != len(self.constexpr):
            name = getattr(self.kernel, "__name__", "the kernel")
            raise TypeError(f"{name} takes {len(self.constexpr)} arguments, given {len(args)}")
        if self.constexpr is None or knobs is None or getattr(self.kernel, "pre_run_hooks", None):
            self.kernel[grid](*args, num_warps=num_warps)
            return
        device = driver.active.get_current_device()
        key = (device, num_warps, *map(_variant_class, args, self.constexpr))
        compiled = self.variants.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)
            if hasattr(compiled, "packed_metadata"):  # a compiled kernel (not a CPU interpreter's result)
                self.variants[key] = compiled
            return
        grid3 = (*grid, 1, 1)
        stream = driver.active.get_current_stream(device)
        compiled.run(
            grid3[0],
            grid3[1],
            grid3[2],
            stream,
            compiled.function,
            compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *args),
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *args,
        )


def _variant_class(arg: Any, constexpr: bool) -> Any:
    """What of an argument Triton compiles apart: a constexpr's value; a tensor's dtype and whether its
    address is a multiple of 16; an integer's width and whether it is 1 or a multiple of 16; a float's
    type; None."""
    if constexpr or arg is None or isinstance(arg, bool):
        return ("=", arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)
    if isinstance(arg, float):
        return ("f",)
    return ("=", arg)
