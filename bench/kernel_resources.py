"""Every Triton kernel of the engine compiled for an H200 (sm_90) without a GPU: the launchers called on CPU
tensors at an architecture's shapes, as its steps call them (decode at batches 1, 8 and 256, prompt
chunks, bf16 and fp8 KV caches, FP8 weights, the MoE paths), each launch compiled and not run
(worker/kernel_compile.py). Prints each launch's registers and spilled bytes a thread, shared memory a
program, the warps an SM can hold at those (occupancy), and the barriers in a program's code (batch 1's
kernels are latency-bound, and a reduction across warps waits at one or two). A kernel that fails to compile fails here,
on any machine: tests/test_kernel_compile.py runs this on the tiny architectures.

    python bench/kernel_resources.py [--arch qwen3-0.6b qwen3-30b-a3b ...] [--arch-sm 90] [--out r.json]"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # Triton must be imported to compile, not to interpret
    del os.environ["TRITON_INTERPRET"]
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default it has had (Triton 3.9 warns)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python bench/x.py` from anywhere

from common import ARCHS  # noqa: E402

from worker import gemv, skinny_gemm, triton_decode, triton_ops  # noqa: E402
from worker.kernel_compile import MAX_SHARED_BYTES, CompiledLaunch, compile_only, on_gpu  # noqa: E402
from worker.layers.moe import fused  # noqa: E402
from worker.layers.moe.weights import ExpertScales  # noqa: E402
from worker.quant import fused_quant, gemm  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DECODE_BATCHES = (1, 8, 256)
PAGE_SIZE = 16
# an H200's SM: 64K registers, 227 KB of shared memory a program at most, 64 warps, 32 programs
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS = 65536, MAX_SHARED_BYTES[90], 64, 32


def _gpu(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """An unwritten CPU tensor posing as a GPU one (Triton reads only its pointer and dtype)."""
    return on_gpu(torch.empty(*shape, dtype=dtype))


def _ids(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return on_gpu(torch.zeros(*shape, dtype=dtype))


def launches(arch: str) -> list[tuple[str, Callable[[], object]]]:
    """(where, a call of a launcher) for each launch the architecture's steps make."""
    cfg = ARCHS[arch]
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, vocab = cfg.get("head_dim") or hidden // heads, cfg["vocab_size"]
    qkv_width = (heads + 2 * kv_heads) * head_dim
    calls: list[tuple[str, Callable[[], object]]] = []

    for cache in (BF16, FP8):
        k_cache, v_cache = _gpu(4096, kv_heads, head_dim, dtype=cache), _gpu(4096, kv_heads, head_dim, dtype=cache)
        for tokens in triton_ops.PROLOGUE_TILE_STARTS:
            calls.append(
                (
                    f"attention prologue, {tokens} tokens, {_name(cache)} cache",
                    lambda t=tokens, k=k_cache, v=v_cache: triton_ops.qkv_prologue(
                        _gpu(t, qkv_width),
                        _ids(t),
                        _ids(t),
                        _gpu(4096, head_dim, dtype=torch.float32),
                        _gpu(head_dim),
                        _gpu(head_dim),
                        1e-6,
                        k,
                        v,
                        heads,
                        kv_heads,
                        head_dim,
                    ),
                )
            )
        calls.append(
            (
                f"KV store, {_name(cache)} cache",
                lambda k=k_cache, v=v_cache: triton_ops.kv_store(
                    _ids(64), _gpu(64, kv_heads, head_dim), _gpu(64, kv_heads, head_dim), k, v
                ),
            )
        )
        pages = _gpu(4096, PAGE_SIZE, kv_heads, head_dim, dtype=cache)
        for batch in DECODE_BATCHES:
            splits = triton_decode.decode_num_splits(batch, kv_heads)
            # each of the fp8 path's choices both ways (the default takes convert_v at batch 256 only)
            fp8_variants = [
                {"prefetch": False},
                {"prefetch": True},
                {"cuda_cores": True},
                {"convert_v": True},
                {"convert_v": False},
            ]
            variants = [{}] + (fp8_variants if cache == FP8 else [])
            if splits > 1:  # the split results merged by the last split's program, and by a launch of their own
                variants += [{"merge_in_last": True}, {"merge_in_last": False}]
            for variant in variants:
                calls.append(
                    (
                        f"decode attention, batch {batch}, {_name(cache)} cache{_variant(variant)}",
                        lambda b=batch, s=splits, p=pages, v=variant: triton_decode.paged_decode(
                            _gpu(b, heads, head_dim),
                            p,
                            p,
                            _ids(b + 1, dtype=torch.int32),
                            _ids(4096, dtype=torch.int32),
                            _ids(b, dtype=torch.int32),
                            num_splits=s,
                            **v,
                        ),
                    )
                )

    for batch in (1, 256):
        calls.append(
            (
                f"sampling, batch {batch}",
                lambda b=batch: triton_ops.sample_rows(
                    _gpu(b, vocab, dtype=torch.float32),
                    _gpu(b, dtype=torch.float32),
                    _ids(b),
                    _ids(b),
                    token_pool=_ids(4096, dtype=torch.int32),
                    token_write=_ids(b),
                ),
            )
        )

    # batch-1 decode's row fusion: the residual norm into the QKV GEMV, SiLU-and-multiply into down's
    calls.append(
        (
            "norm + QKV GEMV, batch 1",
            lambda: gemv.norm_linear(_gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(qkv_width, hidden)),
        )
    )
    calls.append(
        (
            "norm + QKV GEMV in two passes, batch 1",
            lambda: gemv.norm_linear(
                _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(qkv_width, hidden), one_block=False
            ),
        )
    )
    calls.append(
        (
            "small GEMV (o), batch 1",
            lambda: gemv.small_linear(_gpu(1, heads * head_dim), _gpu(hidden, heads * head_dim)),
        )
    )
    calls.append(("LM head GEMV, batch 1", lambda: gemv.small_linear(_gpu(1, hidden), _gpu(vocab, hidden))))
    if "num_experts" in cfg:
        calls.extend(_moe_launches(cfg, hidden))
    else:
        inter = cfg["intermediate_size"]
        calls.append(("SiLU + down GEMV, batch 1", lambda: gemv.silu_linear(_gpu(1, 2 * inter), _gpu(hidden, inter))))
        calls.append(
            (
                "gate-up GEMV + SiLU, batch 1",
                lambda: gemv.small_linear(_gpu(1, hidden), _gpu(2 * inter, hidden), gated=True),
            )
        )
        calls.append(
            (
                "norm + gate-up GEMV + SiLU, batch 1",
                lambda: gemv.norm_linear(
                    _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(2 * inter, hidden), gated=True
                ),
            )
        )
        calls.extend(_fp8_launches(hidden, inter))
    return calls + _pdl_launches(cfg)


def _pdl_launches(cfg: dict) -> list[tuple[str, Callable[[], object]]]:
    """Batch-1 decode's Triton kernels launched with programmatic dependent launch (Kernels.pdl)."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, vocab = cfg.get("head_dim") or hidden // heads, cfg["vocab_size"]
    qkv_width = (heads + 2 * kv_heads) * head_dim

    def decode(cache: torch.dtype, batch: int = 1, **variant) -> Callable[[], object]:
        pages = _gpu(4096, PAGE_SIZE, kv_heads, head_dim, dtype=cache)
        return lambda: triton_decode.paged_decode(
            _gpu(batch, heads, head_dim),
            pages,
            pages,
            _ids(batch + 1, dtype=torch.int32),
            _ids(4096, dtype=torch.int32),
            _ids(batch, dtype=torch.int32),
            num_splits=triton_decode.decode_num_splits(batch, kv_heads),
            pdl=True,
            **variant,
        )

    calls = [
        (
            "attention prologue, 1 token, pdl",
            lambda: triton_ops.qkv_prologue(
                _gpu(1, qkv_width),
                _ids(1),
                _ids(1),
                _gpu(4096, head_dim, dtype=torch.float32),
                _gpu(head_dim),
                _gpu(head_dim),
                1e-6,
                _gpu(4096, kv_heads, head_dim),
                _gpu(4096, kv_heads, head_dim),
                heads,
                kv_heads,
                head_dim,
                pdl=True,
            ),
        ),
        ("decode attention, batch 1, bf16 cache, pdl", decode(BF16)),
        ("decode attention, batch 1, fp8 cache, pdl", decode(FP8)),
        ("decode attention, batch 1, fp8 cache, cuda_cores, pdl", decode(FP8, cuda_cores=True)),
        ("decode attention, batch 1, fp8 cache, prefetch, pdl", decode(FP8, prefetch=True)),
        ("decode attention, batch 256 (one split), fp8 cache, pdl", decode(FP8, 256)),
        (
            "sampling, batch 1, pdl",
            lambda: triton_ops.sample_rows(
                _gpu(1, vocab, dtype=torch.float32),
                _gpu(1, dtype=torch.float32),
                _ids(1),
                _ids(1),
                token_pool=_ids(4096, dtype=torch.int32),
                token_write=_ids(1),
                pdl=True,
            ),
        ),
        (
            "norm + QKV GEMV, batch 1, pdl",
            lambda: gemv.norm_linear(
                _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(qkv_width, hidden), pdl=True
            ),
        ),
        (
            "norm + QKV GEMV, the first layer (no residual), one block, batch 1, pdl",
            lambda: gemv.norm_linear(
                _gpu(1, hidden), None, _gpu(hidden), 1e-6, _gpu(qkv_width, hidden), one_block=True, pdl=True
            ),
        ),
        (
            "small GEMV (o), batch 1, pdl",
            lambda: gemv.small_linear(_gpu(1, heads * head_dim), _gpu(hidden, heads * head_dim), pdl=True),
        ),
    ]
    if "num_experts" in cfg:
        experts, top_k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        calls.append(
            (
                "norm + router GEMV writing the normed row, batch 1, pdl",
                lambda: gemv.norm_linear(
                    _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(experts, hidden), True, pdl=True
                ),
            )
        )
        calls.append(
            (
                "MoE experts, 1 token, pdl",
                lambda: fused.fused_moe(
                    _gpu(1, hidden),
                    _gpu(1, experts),
                    _gpu(experts, 2 * inter, hidden),
                    _gpu(experts, hidden, inter),
                    top_k,
                    cfg["norm_topk_prob"],
                    pdl=True,
                ),
            )
        )
        return calls
    inter = cfg["intermediate_size"]
    weight = _gpu(2 * inter, hidden, dtype=FP8)
    calls.append(
        (
            "SiLU + down GEMV, batch 1, pdl",
            lambda: gemv.silu_linear(_gpu(1, 2 * inter), _gpu(hidden, inter), pdl=True),
        )
    )
    calls.append(
        (
            "FP8 GEMV, batch 1, per-channel scales, pdl",
            lambda: gemm.fp8_gemv(_gpu(1, hidden), weight, _gpu(2 * inter, 1, dtype=torch.float32), None, pdl=True),
        )
    )
    blocks = _gpu(-(-2 * inter // 128), -(-hidden // 128), dtype=torch.float32)
    calls.append(
        (
            "FP8 GEMV, batch 1, block scales, pdl",
            lambda: gemm.fp8_gemv(_gpu(1, hidden), weight, blocks, (128, 128), pdl=True),
        )
    )
    calls.append(
        (
            "gate-up GEMV + SiLU, batch 1, pdl",
            lambda: gemv.small_linear(_gpu(1, hidden), _gpu(2 * inter, hidden), pdl=True, gated=True),
        )
    )
    calls.append(
        (
            "FP8 gate-up GEMV + SiLU, batch 1, block scales, pdl",
            lambda: gemm.fp8_gemv(_gpu(1, hidden), weight, blocks, (128, 128), pdl=True, gated=True),
        )
    )
    calls.append(
        (
            "FP8 gate-up GEMV + SiLU, batch 1, block scales a block, pdl",
            lambda: gemm.fp8_gemv(_gpu(1, hidden), weight, blocks, (128, 128), pdl=True, gated=True, grouped=True),
        )
    )
    calls.append(
        (
            "norm + gate-up GEMV + SiLU, batch 1, pdl",
            lambda: gemv.norm_linear(
                _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, _gpu(2 * inter, hidden), pdl=True, gated=True
            ),
        )
    )
    # Kernels.fp8_norms inside and folded: the norm in qkv's and gate-up's FP8 GEMVs, the residual in o's and down's
    channel_scales = _gpu(2 * inter, dtype=torch.float32)
    for folded in (False, True):
        norm = gemm.RowNorm(None if folded else _gpu(hidden), 1e-6)
        calls.append(
            (
                f"norm{' (folded)' if folded else ''} + FP8 gate-up GEMV + SiLU, batch 1, per-channel scales, pdl",
                lambda norm=norm: gemm.fp8_gemv(
                    _gpu(1, hidden), weight, channel_scales, None, pdl=True, gated=True, norm=norm
                ),
            )
        )
    qkv_fp8 = _gpu(qkv_width, hidden, dtype=FP8)
    calls.append(
        (
            "norm + FP8 QKV GEMV, batch 1, per-channel scales, pdl",
            lambda: gemm.fp8_gemv(
                _gpu(1, hidden),
                qkv_fp8,
                _gpu(qkv_width, dtype=torch.float32),
                None,
                pdl=True,
                norm=gemm.RowNorm(_gpu(hidden), 1e-6),
            ),
        )
    )
    down = _gpu(hidden, inter, dtype=FP8)
    calls.append(
        (
            "FP8 down GEMV + residual, batch 1, per-channel scales, pdl",
            lambda: gemm.fp8_gemv(
                _gpu(1, inter), down, _gpu(hidden, dtype=torch.float32), None, pdl=True, residual=_gpu(1, hidden)
            ),
        )
    )
    return calls


def _moe_launches(cfg: dict, hidden: int) -> list[tuple[str, Callable[[], object]]]:
    experts, top_k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    w13, w2 = _gpu(experts, 2 * inter, hidden), _gpu(experts, hidden, inter)

    def experts_of(tokens: int) -> object:
        if tokens * top_k <= fused.ALIGN_KERNEL_MAX_ROWS:  # routed and sorted on the device
            return fused.fused_moe(_gpu(tokens, hidden), _gpu(tokens, experts), w13, w2, top_k, cfg["norm_topk_prob"])
        # sorted by torch ops, which read the routing's ids: given here, as no kernel writes them
        ids = _ids(tokens, top_k, dtype=torch.int32)
        return fused.fused_experts(_gpu(tokens, hidden), w13, w2, _ids(tokens, top_k, dtype=BF16), ids)

    def in_a_loop(call: Callable[[], object]) -> object:
        # the per-row down kernel's loop over choices (not its at-once variant)
        before, fused.PER_ROW_DOWN_AT_ONCE = fused.PER_ROW_DOWN_AT_ONCE, None
        try:
            return call()
        finally:
            fused.PER_ROW_DOWN_AT_ONCE = before

    def down_in_a_loop() -> object:
        return in_a_loop(lambda: experts_of(1))

    def fp8_experts_of(tokens: int, group: int, loop: bool = False, w8a8: bool | None = None) -> object:
        # e4m3 experts: a scale a row (group 0, quantization at load) or 128 columns' (block-scaled checkpoints)
        groups = (-(-hidden // group), -(-inter // group)) if group else (1, 1)
        scales = ExpertScales(
            _gpu(experts, 2 * inter, groups[0], dtype=torch.float32),
            _gpu(experts, hidden, groups[1], dtype=torch.float32),
            group,
            group,
        )
        q13, q2 = _gpu(experts, 2 * inter, hidden, dtype=FP8), _gpu(experts, hidden, inter, dtype=FP8)
        x, logits = _gpu(tokens, hidden), _gpu(tokens, experts)
        if tokens * top_k > fused.ALIGN_KERNEL_MAX_ROWS or w8a8 is not None:  # the ids given, as in experts_of
            ids = _ids(tokens, top_k, dtype=torch.int32)
            return fused.fused_experts(x, q13, q2, _ids(tokens, top_k, dtype=BF16), ids, scales=scales, w8a8=w8a8)
        call = lambda: fused.fused_moe(x, logits, q13, q2, top_k, cfg["norm_topk_prob"], scales=scales)  # noqa: E731
        return in_a_loop(call) if loop else call()

    fp8_counts = fused.warm_token_counts(experts, top_k)
    return (
        [
            (f"MoE experts, {tokens} tokens", lambda t=tokens: experts_of(t))
            for tokens in fused.warm_token_counts(experts, top_k)
        ]
        + [("MoE experts, 1 token, down in a loop over choices", down_in_a_loop)]
        + [
            (
                f"FP8 MoE experts, {tokens} tokens, scales {group or 'a row'}",
                lambda t=tokens, g=group: fp8_experts_of(t, g),
            )
            for tokens in fp8_counts
            for group in (0, 128)
        ]
        + [
            (
                f"FP8 MoE experts, 1 token, down in a loop, scales {group or 'a row'}",
                lambda g=group: fp8_experts_of(1, g, True),
            )
            for group in (0, 128)
        ]
        # the grouped GEMMs widening the weights (w8a16): what scales of column groups take where a group is
        # narrower than the layer (a tiny architecture's 128 span its rows, and they take w8a8)
        + [
            (f"FP8 MoE experts, {tokens} tokens, weights widened", lambda t=tokens: fp8_experts_of(t, 0, w8a8=False))
            for tokens in fp8_counts
            if not fused.per_row_applies(tokens * top_k, experts)
        ]
    )


def _fp8_launches(hidden: int, inter: int) -> list[tuple[str, Callable[[], object]]]:
    """FP8 weights: the GEMV of a few rows (per-channel and 128 x 128 block scales), the block-scaled GEMM
    with its activations' quantization, and the quantization inside the norm and SiLU."""
    weight = _gpu(2 * inter, hidden, dtype=FP8)
    channel, blocks = (
        _gpu(2 * inter, 1, dtype=torch.float32),
        _gpu(-(-2 * inter // 128), -(-hidden // 128), dtype=torch.float32),
    )
    calls = [
        (f"FP8 GEMV, batch 1, {name} scales", lambda s=scale, b=block: gemm.fp8_gemv(_gpu(1, hidden), weight, s, b))
        for name, scale, block in (("per-channel", channel, None), ("block", blocks, (128, 128)))
    ]
    calls += [
        (
            f"FP8 gate-up GEMV + SiLU, batch 1, {name} scales",
            lambda s=scale, b=block: gemm.fp8_gemv(_gpu(1, hidden), weight, s, b, gated=True),
        )
        for name, scale, block in (("per-channel", channel, None), ("block", blocks, (128, 128)))
    ]
    calls += [
        (
            f"FP8 {what}, batch 1, block scales a block",
            lambda g=gated: gemm.fp8_gemv(_gpu(1, hidden), weight, blocks, (128, 128), gated=g, grouped=True),
        )
        for what, gated in (("GEMV", False), ("gate-up GEMV + SiLU", True))
    ]
    # the residual norm inside the FP8 GEMVs (scales a row, as an FP8 linear keeps them; block scales repeated
    # over their block's rows)
    row_blocks = _gpu(2 * inter, -(-hidden // 128), dtype=torch.float32)
    calls += [
        (
            f"norm + FP8 {what}, batch 1, {name} scales",
            lambda s=scale, b=block, g=gated: gemv.norm_linear(
                _gpu(1, hidden), _gpu(1, hidden), _gpu(hidden), 1e-6, weight, scale=s, block=b, gated=g
            ),
        )
        for name, scale, block in (
            ("per-channel", _gpu(2 * inter, dtype=torch.float32), None),
            ("block", row_blocks, (128, 128)),
        )
        for what, gated in (("GEMV", False), ("gate-up GEMV + SiLU", True))
    ]
    calls += [
        (
            f"FP8 block-scaled GEMM, {rows} rows",
            lambda m=rows: gemm.block_scaled_mm(_gpu(m, hidden), weight, blocks, 128),
        )
        for rows in (16, 256, 8192)
    ]
    # decode batches' per-channel product through the Triton GEMM (its own tile at each row count)
    calls += [
        (
            f"FP8 per-channel Triton GEMM, {rows} rows",
            lambda m=rows: skinny_gemm.matmul(
                _gpu(m, hidden, dtype=FP8), weight, BF16, _gpu(m, 1, dtype=torch.float32), channel
            ),
        )
        for rows in (2, 16, 64, 128)
    ]
    # a full decode batch through an N = hidden layer (o's shape: skinny_gemm.FULL_BATCH_TILE)
    calls.append(
        (
            "FP8 per-channel Triton GEMM, 256 rows, o's shape",
            lambda: skinny_gemm.matmul(
                _gpu(256, hidden, dtype=FP8),
                _gpu(hidden, hidden, dtype=FP8),
                BF16,
                _gpu(256, 1, dtype=torch.float32),
                _gpu(hidden, 1, dtype=torch.float32),
            ),
        )
    )
    # the same GEMM over bf16 at an N = hidden layer (o's shape: split over K)
    calls += [
        (
            f"bf16 Triton GEMM, {rows} rows, o's shape",
            lambda m=rows: skinny_gemm.matmul(_gpu(m, hidden), _gpu(hidden, hidden), BF16),
        )
        for rows in (16, 64, 128)
    ]
    # the per-token quantization inside the residual norm and SiLU before a per-channel FP8 linear
    calls += [
        (
            "FP8 input: residual norm and quantization, 256 rows",
            lambda: fused_quant.norm_quant(_gpu(256, hidden), _gpu(256, hidden), _gpu(hidden), 1e-6),
        ),
        ("FP8 input: SiLU and quantization, 256 rows", lambda: fused_quant.silu_quant(_gpu(256, 2 * inter))),
    ]
    return calls


def _name(dtype: torch.dtype) -> str:
    return {BF16: "bf16", FP8: "fp8"}[dtype]


def _variant(variant: dict) -> str:
    return "".join(f", {k}" if on else f", no {k}" for k, on in variant.items())


def occupancy(launch: CompiledLaunch) -> int:
    """Warps an SM holds at once: bounded by registers (allocated 8 a thread at a time, a warp's 256 at a
    time), shared memory and the SM's warp and program counts."""
    warps = launch.constants.get("num_warps", 4)
    per_warp = -(-max(launch.registers, 1) * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED // launch.shared_bytes if launch.shared_bytes else SM_PROGRAMS
    return min(by_registers, by_shared, SM_PROGRAMS, SM_WARPS // warps) * warps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"], choices=sorted(ARCHS))
    p.add_argument(
        "--arch-sm", type=int, default=90, help="the GPU's compute capability, major and minor (90: H100/H200)"
    )
    p.add_argument("--out", help="write the launches as JSON here")
    args = p.parse_args()
    report, failed = [], []
    for arch in args.arch:
        print(f"== {arch}, compiled for sm_{args.arch_sm} ==")
        print(f"{'launch':<48} {'kernel':<26} {'regs':>4} {'spill':>5} {'smem':>6} {'warps/SM':>8} {'bars':>4}")
        for where, call in launches(arch):
            with compile_only(args.arch_sm) as compiled:
                try:
                    call()
                except Exception as e:  # a kernel that does not compile: named, and the rest still compiled
                    failed.append(f"{arch}: {where}: {type(e).__name__}: {e}")
                    print(f"{where:<48} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    continue
            for launch in compiled.launches:
                print(
                    f"{where:<48} {launch.kernel:<26} {launch.registers:>4} {launch.spilled_bytes:>5} "
                    f"{launch.shared_bytes:>6} {occupancy(launch):>8} {launch.barriers:>4}"
                )
                report.append({"arch": arch, "launch": where, **vars(launch), "warps_per_sm": occupancy(launch)})
                if launch.launch_pdl and (launch.memory_before_wait or launch.returns_before_wait):
                    failed.append(
                        f"{arch}: {where}: {launch.kernel} may touch global memory ({launch.memory_before_wait}) "
                        f"or return ({launch.returns_before_wait}) before its wait on the kernel before"
                    )
    if args.out:
        Path(args.out).write_text(json.dumps({"launches": report, "failed": failed}, indent=2, default=str))
    if failed:
        raise SystemExit("did not compile:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
