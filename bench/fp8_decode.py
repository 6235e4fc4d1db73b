"""One layer's decode attention on one GPU, Qwen3-0.6B shapes (16 query heads, 8 KV heads, head_dim 128):
the Triton split-KV kernel of worker/triton_decode.py over a float8 e4m3 and a bfloat16 cache (a sweep of
its tile, warps, stages and splits, beside the launcher's own choices; with --variants its CUDA-core and
prefetching variants too, and over fp8 V converted to float16 before it is staged) against
FlashInfer's decode over both (tensor cores, and at up to 8 rows its CUDA-core kernels too). Batch 256
with KV lengths uniform in 150..1600 (seeded) and batch 1 with 560 tokens; 20 calls replayed in a CUDA
graph, median of 5 replays; microseconds a call, TB/s of K and V read once, the largest difference from
FlashInfer's tensor-core output over the same cache.

    python bench/fp8_decode.py [--batch 256 1] [--page-size 16] [--sweep none|small|full] [--variants] [--kv fp8]
        [--heads 32 8] [--sweep-order longest_first] [--out r.json]

--heads times another model's query and KV heads (Qwen3-8B: 32 8; Qwen3-30B-A3B: 32 4); --sweep-order starts the
sweep's tiles' programs in that order too (the launcher's own rows run in both orders regardless)."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python bench/x.py` from anywhere

from common import time_graph  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
CALLS, REPLAYS = 20, 5
# (block_n, num_warps, num_stages) of the kernel's variants (--variants): the CUDA-core one, and K and V
# loaded from cells found the block before
CUDA_CORE_TILES = [(16, 4, 2), (32, 4, 2), (32, 2, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3)]
# (128 x 4 x 2 and 64 x 4 x 2 were slower than three stages on 2026-12-05; 256 x 8 x 3 fits an fp8 cache's tiles
# in shared memory, not bf16's)
PREFETCH_TILES = [
    (None, None, None),
    (64, 4, 3),
    (128, 4, 3),
    (128, 4, 4),
    (128, 8, 3),
    (128, 8, 4),
    (256, 8, 3),
    (32, 4, 3),
]
# V converted before staging, without the prefetch: the plain kernel's tile and smaller ones (fewer registers:
# 156 a thread at 128 x 4 x 2 in sm_90 code against 255 for the default, so three programs an SM)
CONVERT_V_TILES = [(128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (128, 8, 2)]
# (block_n, num_warps, num_stages) beside the launcher's default (None: its choice)
TILES = {
    "none": [(None, None, None)],
    "small": [(None, None, None), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2)],
    "full": [
        (None, None, None),
        (16, 4, 2),
        (32, 4, 2),
        (32, 4, 3),
        (64, 2, 2),
        (64, 4, 2),
        (64, 4, 3),
        (64, 8, 2),
        (128, 4, 2),
        (128, 4, 3),
        (128, 8, 2),
        (128, 8, 3),
        (256, 8, 2),
    ],
}


def splits_to_try(batch: int) -> list[int]:
    from worker.triton_decode import decode_num_splits

    chosen = decode_num_splits(batch, NUM_KV_HEADS)
    extra = [1, 2, 4] if batch >= 64 else [8, 16, 32]
    return sorted({chosen, *extra})


def lengths(batch: int, seed: int) -> list[int]:
    if batch == 1:
        return [560]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(150, 1601, (batch,), generator=g).tolist()


def make_cache(lens: list[int], page_size: int, seed: int):
    """A bf16 and an fp8 cache of the same (rounded) values, their pages shuffled over the pool, and the
    CSR page lists on the device."""
    from worker.kv_cache import to_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages)
    shape = (num_pages, page_size, NUM_KV_HEADS, HEAD_DIM)
    fp8 = [to_fp8(torch.randn(shape, device="cuda", generator=g)) for _ in range(2)]
    caches = {"fp8": tuple(fp8), "bf16": tuple(x.bfloat16() for x in fp8)}  # same values: comparable outputs
    ids = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32)
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, caches, indptr, ids, last


def permuted_pages(perm: torch.Tensor, indptr: torch.Tensor, ids: torch.Tensor, last: torch.Tensor):
    """The CSR page lists of the rows taken in `perm`'s order: (indptr, ids, last) of the permuted batch."""
    counts = (indptr[1:] - indptr[:-1])[perm]
    new_indptr = torch.zeros_like(indptr)
    new_indptr[1:] = torch.cumsum(counts, 0)
    new_ids = torch.cat([ids[indptr[r] : indptr[r + 1]] for r in perm.tolist()])
    return new_indptr, new_ids, last[perm]


def flashinfer_decode(flashinfer, q, cache, indptr, ids, last, page_size: int, tensor_cores: bool = True):
    """FlashInfer's decode of q over cache, planned once: a callable."""
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(
        indptr.cpu(),
        ids,
        last.cpu(),
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        page_size,
        q_data_type=q.dtype,
        kv_data_type=cache[0].dtype,
    )
    # tvm-ffi launches on torch's current stream only where torch exports its DLPack exchange API
    # (as worker/attention/flashinfer_backend.py does); a capture needs the side stream
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        on_torch_stream = contextlib.nullcontext
    else:
        import tvm_ffi

        on_torch_stream = tvm_ffi.use_torch_stream

    def run() -> torch.Tensor:
        with on_torch_stream():
            return wrapper.run(q, cache)

    return run


def bench_batch(batch: int, args: argparse.Namespace, flashinfer) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from worker.triton_decode import decode_scratch, longest_first, paged_decode

    lens = lengths(batch, args.seed)
    q, caches, indptr, ids, last = make_cache(lens, args.page_size, args.seed)
    tokens = sum(lens)
    orders = {
        "longest_first": torch.from_numpy(longest_first(lens)).cuda(),
        "rows": torch.arange(batch, dtype=torch.int32, device="cuda"),
    }
    rows = []
    for kv, cache in caches.items():
        if kv not in args.kv:
            continue
        kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * cache[0].element_size()
        base = {
            "batch": batch,
            "kv_tokens": tokens,
            "page_size": args.page_size,
            "kv_dtype": kv,
            "kv_mbytes": kv_bytes / 1e6,
        }
        want = None
        if flashinfer is not None:
            from worker.attention.flashinfer_backend import use_tensor_cores

            for tc in sorted({True, use_tensor_cores(batch)}, reverse=True):  # the engine's pick, and tensor cores
                run = flashinfer_decode(flashinfer, q, cache, indptr, ids, last, args.page_size, tc)
                got_fi = run().float()
                want = got_fi if want is None else want
                us = time_graph(run, REPLAYS, CALLS)
                rows.append(
                    {
                        **base,
                        "impl": "flashinfer_" + ("tensor_cores" if tc else "cuda_cores"),
                        "us": us,
                        "tb_s": kv_bytes / us / 1e6,
                        "max_abs_diff_vs_flashinfer": (got_fi - want).abs().max().item(),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            if batch > 1:  # the rows put longest first, as the scheduler does with decode_order sorted_rows
                perm = orders["longest_first"].long()
                run = flashinfer_decode(
                    flashinfer, q[perm], cache, *permuted_pages(perm, indptr, ids, last), args.page_size
                )
                got_sorted = torch.empty_like(want)
                got_sorted[perm] = run().float()
                us = time_graph(run, REPLAYS, CALLS)
                rows.append(
                    {
                        **base,
                        "impl": "flashinfer_tensor_cores_sorted_rows",
                        "us": us,
                        "tb_s": kv_bytes / us / 1e6,
                        "max_abs_diff_vs_flashinfer": (got_sorted - want).abs().max().item(),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        out = torch.empty_like(q)
        dots = [None, False] if kv == "fp8" else [None]  # fp8: the float16 operands (default), bf16's
        runs = [
            (tile, dot, {})
            for tile, dot in itertools.product(TILES[args.sweep], dots)
            if dot is None or tile[0] is None
        ]  # bf16 operands over fp8 with the default tile only
        runs.insert(0, ((None, None, None), None, {"launcher": True}))  # every choice the launcher's own
        # and with the split results merged by the last split's program instead of a launch of their own
        runs.insert(1, ((None, None, None), None, {"launcher": True, "merge_in_last": True}))
        # and with the programs of the longest requests started first (Kernels.decode_order)
        runs.insert(2, ((None, None, None), None, {"launcher": True, "order": "longest_first"}))
        # the same launch over the rows in their own order: what the grid's kv-head-first layout gives alone
        runs.insert(3, ((None, None, None), None, {"launcher": True, "order": "rows"}))
        if args.variants:  # the kernel's variants, each at tiles of its own
            runs += [(tile, None, {"prefetch": True}) for tile in PREFETCH_TILES]
            runs += [(tile, None, {"cuda_cores": True}) for tile in CUDA_CORE_TILES]
            runs += [(tile, None, {"cuda_cores": True, "prefetch": True}) for tile in CUDA_CORE_TILES]
            if kv == "fp8":  # V converted to float16 before it is staged, with and without the prefetch
                runs += [(tile, None, {"prefetch": True, "convert_v": True}) for tile in PREFETCH_TILES]
                runs += [(tile, None, {"convert_v": True}) for tile in CONVERT_V_TILES]
        for splits, ((block_n, warps, stages), f16_dot, variant) in itertools.product(splits_to_try(batch), runs):
            if variant and splits != _default_splits(batch):
                continue  # the variants at the launcher's split count only
            # the plain kernel unless the variant says otherwise; the launcher's row leaves it every choice
            if variant.get("launcher"):
                choices = {"merge_in_last": bool(variant.get("merge_in_last"))}
                if variant.get("order"):  # the launcher's own merge, as the engine runs it
                    choices.update(order=orders[variant["order"]], merge_in_last=None)
            else:
                choices = {"prefetch": False, "convert_v": False, "merge_in_last": False, **variant}
                if args.sweep_order:
                    choices["order"] = orders[args.sweep_order]
            scratch = decode_scratch(batch, NUM_HEADS, HEAD_DIM, splits, "cuda")

            def call() -> torch.Tensor:
                return paged_decode(
                    q,
                    *cache,
                    indptr,
                    ids,
                    last,
                    num_splits=splits,
                    out=out,
                    scratch=scratch,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                    f16_dot=f16_dot,
                    **choices,
                )

            try:
                got = call().float()
            except OutOfResources as err:  # a tile past the GPU's shared memory for this cache's dtype
                print(f"batch {batch} {kv} splits={splits} tile {block_n}x{warps}x{stages} {variant}: {err}")
                continue
            us = time_graph(call, REPLAYS, CALLS)
            row = {
                **base,
                "impl": "triton",
                "num_splits": splits,
                "block_n": block_n,
                "num_warps": warps,
                "num_stages": stages,
                "dot": _dot_name(kv, f16_dot, variant),
                "launcher": bool(variant.get("launcher")),
                "prefetch": bool(variant.get("prefetch")),
                "convert_v": bool(variant.get("convert_v")),
                "merge_in_last": choices["merge_in_last"],  # None: the launcher's choice
                "order": variant.get("order") if variant.get("launcher") else args.sweep_order,
                "us": us,
                "tb_s": kv_bytes / us / 1e6,
            }
            if want is not None:
                row["max_abs_diff_vs_flashinfer"] = (got - want).abs().max().item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _dot_name(kv: str, f16_dot: bool | None, variant: dict) -> str:
    """What a run multiplies with: float32 products on the CUDA cores, or the tensor cores' operands."""
    if variant.get("cuda_cores"):
        return "cuda_cores"
    return "bf16" if f16_dot is False or kv == "bf16" else "fp16"


def summary(rows: list[dict]) -> None:
    print(f"\n{'batch':>5} {'kv':>4} {'impl':<62} {'us':>8} {'TB/s':>6} {'max|diff|':>9}")
    for (batch, kv), group in itertools.groupby(rows, key=lambda r: (r["batch"], r["kv_dtype"])):
        group = list(group)
        best = [r for r in group if r["impl"] != "triton"]
        triton_rows = [r for r in group if r["impl"] == "triton"]
        # the launcher's own choices, with the merge launched, in the last split, longest first and ordered by row
        default = [r for r in triton_rows if r.get("launcher")]
        if triton_rows:
            fastest = min(triton_rows, key=lambda r: r["us"])
            best += [r for r in default[:4] if r is not fastest] + [fastest]
            for kind in (
                {"dot": "cuda_cores", "prefetch": False},
                {"prefetch": True, "convert_v": False},
                {"prefetch": True, "convert_v": True},
                {"prefetch": False, "convert_v": True},
            ):
                of_kind = [r for r in triton_rows if all(r.get(k) == v for k, v in kind.items())]
                if of_kind and min(of_kind, key=lambda r: r["us"]) is not fastest:
                    best.append(min(of_kind, key=lambda r: r["us"]))
        for r in best:
            name = r["impl"]
            if name == "triton":
                name += (
                    f" splits={r['num_splits']} block_n={r['block_n']} warps={r['num_warps']}"
                    f" stages={r['num_stages']} dot={r['dot']}{' prefetch' if r.get('prefetch') else ''}"
                    f"{' convert_v' if r.get('convert_v') else ''}{' merge in last' if r.get('merge_in_last') else ''}"
                    f"{' ordered ' + r['order'] if r.get('order') else ''}"
                    f"{' (the launcher default)' if r.get('launcher') else ''}"
                )
            diff = r.get("max_abs_diff_vs_flashinfer")
            print(
                f"{batch:>5} {kv:>4} {name:<62} {r['us']:>8.2f} {r['tb_s']:>6.2f} "
                f"{'' if diff is None else f'{diff:.2e}':>9}"
            )


def _default_splits(batch: int) -> int:
    from worker.triton_decode import decode_num_splits

    return decode_num_splits(batch, NUM_KV_HEADS)


def main() -> None:
    global NUM_HEADS, NUM_KV_HEADS  # --heads
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep",
        choices=sorted(TILES),
        default="small",
        help="the tiles tried beside the launcher's default (none: it alone), at each split count",
    )
    parser.add_argument("--no-flashinfer", action="store_true", help="time the Triton kernel alone")
    parser.add_argument("--kv", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"], help="the caches timed")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also the Triton kernel's variants (paged_decode's cuda_cores, prefetch and convert_v) at tiles of their own",
    )
    parser.add_argument(
        "--heads", type=int, nargs=2, metavar=("Q", "KV"), default=[NUM_HEADS, NUM_KV_HEADS], help="query and KV heads"
    )
    parser.add_argument(
        "--sweep-order", choices=["longest_first", "rows"], help="the order the sweep's tiles start their programs in"
    )
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    NUM_HEADS, NUM_KV_HEADS = args.heads
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_decode.py times CUDA kernels: run it on a GPU host")
    flashinfer = None
    if not args.no_flashinfer:
        import flashinfer  # imported here: the package exists on GPU hosts only
    results = []
    for batch in args.batch:
        results += bench_batch(batch, args, flashinfer)
    summary(results)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"gpu": torch.cuda.get_device_name(), "heads": [NUM_HEADS, NUM_KV_HEADS], "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
