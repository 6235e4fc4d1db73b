"""Launching a Triton kernel through the compiled variant its first launch returned (worker/triton_launch.py):
a launch whose arguments Triton would compile apart goes through Triton again, one of a class already seen
goes straight to the variant with every argument in the kernel's order; on a GPU the attention prologue
gives the same result both ways, whatever the step's size, alignment and cache dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker import triton_launch, triton_ops
from worker.triton_launch import CachedLaunch

pytest.importorskip("triton")


class FakeVariant:
    packed_metadata = "meta"
    function = "fn"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("variant", (g0, g1, g2), stream, args))


class FakeKernel:
    """A jit function of four parameters, the last a constexpr: each launch through it compiles."""

    __name__ = "fake"

    def __init__(self):
        self.params = [SimpleNamespace(is_constexpr=c) for c in (False, False, False, True)]
        self.pre_run_hooks = []
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.log.append(("triton", grid, args, num_warps))
            return FakeVariant(self.log)

        return launch


@pytest.fixture
def fake_driver(monkeypatch):
    if triton_launch.knobs is None:
        pytest.skip("Triton before 3.4 launches every kernel itself")
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(triton_launch, "driver", SimpleNamespace(active=active))


def test_a_launch_of_a_class_seen_goes_to_its_variant_and_another_class_to_triton(fake_driver):
    kernel = FakeKernel()
    launch = CachedLaunch(kernel)
    x = torch.zeros(8, dtype=torch.float32)
    launch((2,), x, 5, 0.5, 64, num_warps=4)  # compiled
    launch((3, 2), x, 7, 1.5, 64, num_warps=4)  # the same class: 5 and 7 are neither 1 nor multiples of 16
    assert [e[0] for e in kernel.log] == ["triton", "variant"]
    assert kernel.log[1] == ("variant", (3, 2, 1), 1234, (x, 7, 1.5, 64))  # every argument, in order
    for args, warps in (
        ((x, 1, 0.5, 64), 4),  # an integer of 1 is a constant to Triton
        ((x, 32, 0.5, 64), 4),  # a multiple of 16
        ((x, 2**40, 0.5, 64), 4),  # past int32
        ((x, 5, 0.5, 128), 4),  # another constexpr value
        ((x.to(torch.float16), 5, 0.5, 64), 4),  # another dtype
        ((x, 5, 0.5, 64), 8),  # other warps
    ):
        before = len(kernel.log)
        launch((2,), *args, num_warps=warps)
        assert kernel.log[before][0] == "triton", args
    unaligned = torch.zeros(9, dtype=torch.float32)[1:]  # 4 bytes past an aligned block
    launch((2,), unaligned, 5, 0.5, 64, num_warps=4)
    assert kernel.log[-1][0] == "triton"
    with pytest.raises(TypeError, match="takes 4 arguments"):
        launch((2,), x, 5, 0.5, num_warps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_on_gpu_the_prologue_launched_from_its_variant_equals_tritons_launch(fp8):
    from worker import triton_kernels

    heads, kv_heads, head_dim = 16, 8, 128
    width = (heads + 2 * kv_heads) * head_dim
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cos_sin = torch.randn(8192, head_dim, device="cuda")
    qw, kw = torch.rand(head_dim, device="cuda") + 0.5, torch.rand(head_dim, device="cuda") + 0.5
    for tokens in (1, 7, 16, 33, 500, 1024, 1025):
        for offset in (0, 1):  # an aligned and an unaligned qkv
            qkv = torch.randn(tokens * width + offset, device="cuda", dtype=torch.bfloat16)[offset:].view(tokens, width)
            positions = torch.randint(0, 8192, (tokens,), device="cuda")
            out_loc = torch.randperm(4096, device="cuda")[:tokens]
            results = []
            for cached in (True, True, False):  # the first compiles (or finds) the variant, the second reuses it
                k_cache = torch.zeros(4096, kv_heads, head_dim, device="cuda", dtype=cache_dtype)
                v_cache = torch.zeros_like(k_cache)
                if cached:
                    q = triton_ops.qkv_prologue(
                        qkv, positions, out_loc, cos_sin, qw, kw, 1e-6, k_cache, v_cache, heads, kv_heads, head_dim
                    )
                else:
                    block, warps = triton_ops.prologue_tiles(tokens)
                    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device="cuda")
                    triton_kernels.qkv_prologue_kernel[(-(-tokens // block), heads + kv_heads)](
                        qkv, positions, out_loc, cos_sin, qw, kw, q, k_cache, v_cache, 1e-6, tokens,
                        qkv.stride(0), cos_sin.stride(0), NUM_HEADS=heads, NUM_KV_HEADS=kv_heads,
                        HEAD_DIM=head_dim, HAS_NORM=True, FP8=fp8, BLOCK_T=block, num_warps=warps,
                    )  # fmt: skip
                results.append((q, k_cache.float(), v_cache.float()))
            for got in results[:2]:
                for a, b in zip(got, results[2]):
                    assert torch.equal(a, b), (tokens, offset)
