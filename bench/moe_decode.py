"""One MoE block's experts on one GPU, Qwen3-30B-A3B's shapes (128 experts, 8 a token, hidden 2048, expert
width 768, bf16): the grouped path (routing, the sort by expert, two grouped GEMMs and the sum over
choices) against the per-row kernels (routing inside, two launches) where those apply, with a sweep of
the per-row kernels' tiles (--sweep, at the first token count) and of the grouped GEMMs' (--grouped-sweep,
at every count past the per-row path's: a decode batch of 256 is 256 tokens, a prompt chunk 8,192).
LAYERS copies of the experts (distinct weights, so L2 holds none of them) replayed in a CUDA graph;
median microseconds a layer, the bandwidth over the distinct experts' bytes and the TFLOP/s. The per-row
kernels also with programmatic dependent launch (`per_row_pdl_us`, on compute capability 9.0+). With --fp8
GROUP the experts are e4m3, a scale for every GROUP columns of a row (0: one a row, as quantization at
load makes them; 128: a block-scaled checkpoint's), and the errors are against the weights they stand for.
--inter sets the experts' width: a tensor-parallel rank's slice (192 at tp 4: its down groups of 128 on
ranks 0 and 2, of 64 on ranks 1 and 3). --w8a8 picks where the grouped GEMMs over e4m3 experts quantize
their activations too (fused.W8A8_MIN_BLOCK_M); `grouped_max_rel_err` is the error that costs.

    python bench/moe_decode.py [--tokens 1 2 4 256 8192] [--sweep] [--grouped-sweep] [--fp8 0] [--w8a8 off]
        [--out r.json]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_graph  # noqa: E402

from worker.layers.moe import fused  # noqa: E402
from worker.layers.moe.routing import select_experts  # noqa: E402
from worker.layers.moe.torch_experts import torch_experts  # noqa: E402
from worker.layers.moe.weights import ExpertScales  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 8
# the whole hidden row (2,048) in one step with one to four columns a program too
GATE_UP = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8))) + [
    (1, 2048, 4),
    (2, 2048, 4),
    (2, 2048, 8),
    (4, 2048, 8),
]
DOWN = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)))
# (BLOCK_N, num_warps) of the down kernel's at-once variant (fused.PER_ROW_DOWN_AT_ONCE)
DOWN_AT_ONCE = list(itertools.product((1, 2, 4), (4, 8)))
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMMs: at a decode batch (a few rows an
# expert) short blocks, narrow to wide column tiles and long K steps, deeper or shallower pipelines; at a
# prompt chunk (hundreds of rows an expert) tall blocks
GROUPED_DECODE = [(16, n, k, 4, s) for n, k, s in itertools.product((32, 64, 128), (64, 128, 256), (2, 3, 4))] + [
    (32, n, 128, 4, s) for n, s in itertools.product((64, 128), (2, 3))
]
GROUPED_PREFILL = [(m, n, k, w, 3) for m, n, k, w in itertools.product((64, 128), (64, 128), (64, 128), (4, 8))]
# the same over e4m3 activations and weights (--w8a8): K steps of 128 (64 twice), wider tiles, deeper pipelines
GROUPED_W8A8 = [(m, n, 128, w, s) for m, n, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))] + [
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
]


def _name(part: str, tile: tuple[int, int, int]) -> str:
    return f"{part} {tile[0]}x{tile[1]}w{tile[2]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sweep", action="store_true", help="every per-row tile at the first token count")
    parser.add_argument("--grouped-sweep", action="store_true", help="the grouped GEMMs' tiles past the per-row path")
    parser.add_argument("--fp8", type=int, metavar="GROUP", help="e4m3 experts, a scale every GROUP columns (0: a row)")
    parser.add_argument(
        "--inter", type=int, default=INTER, help="the experts' width, a rank's slice (768 / tp_size at tp > 1)"
    )
    parser.add_argument(
        "--w8a8",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --fp8, the grouped GEMMs' activations quantized to e4m3: where fused.w8a8_applies (auto, from "
        "fused.W8A8_MIN_BLOCK_M rows a block), at every block height, or never (the weights widened to bf16)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    fused.W8A8_MIN_BLOCK_M = {"auto": fused.W8A8_MIN_BLOCK_M, "on": 0, "off": 1 << 30}[args.w8a8]
    inter = args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13s = [
        torch.randn(EXPERTS, 2 * inter, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        for _ in range(LAYERS)
    ]
    w2s = [
        torch.randn(EXPERTS, HIDDEN, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.03
        for _ in range(LAYERS)
    ]
    scales: list[ExpertScales | None] = [None] * LAYERS
    if args.fp8 is not None:  # the bf16 weights become what the e4m3 ones stand for (the references use them)
        for i in range(LAYERS):
            (w13s[i], s13), (w2s[i], s2) = _fp8(w13s[i], args.fp8), _fp8(w2s[i], args.fp8)
            scales[i] = ExpertScales(s13, s2, args.fp8, args.fp8)
    element = 1 if args.fp8 is not None else 2
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(LAYERS, tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
        distinct = sum(len(set(select_experts(logits[i], TOP_K, True)[1].flatten().tolist())) for i in range(LAYERS))
        nbytes = distinct / LAYERS * 3 * inter * HIDDEN * element

        def grouped():
            for i in range(LAYERS):
                w, ids = fused.route(logits[i], TOP_K, True)
                fused.fused_experts(x, w13s[i], w2s[i], w, ids, per_row=False, scales=scales[i])

        def per_row(pdl: bool = False):
            for i in range(LAYERS):
                fused._per_row(x, w13s[i], w2s[i], TOP_K, logits=logits[i], renormalize=True, pdl=pdl, scales=scales[i])

        routings = [select_experts(logits[i], TOP_K, True) for i in range(LAYERS)]

        def per_row_routed():  # the routing given: what routing inside the first kernel costs
            for i in range(LAYERS):
                fused._per_row(x, w13s[i], w2s[i], TOP_K, weights=routings[i][0], ids=routings[i][1], scales=scales[i])

        row = {
            "tokens": tokens,
            "distinct_experts_per_layer": distinct / LAYERS,
            "grouped_us": time_graph(grouped) / LAYERS,
            "grouped_block_m": fused._block_m(tokens * TOP_K, EXPERTS),
        }
        row["grouped_tb_s"] = nbytes / row["grouped_us"] / 1e6
        routing = fused.route(logits[0], TOP_K, True)
        row["w8a8"] = fused.w8a8_applies(scales[0], row["grouped_block_m"], x, inter)
        if scales[0] is not None:  # the error against the weights the e4m3 ones stand for, over exact activations
            got = fused.fused_experts(x, w13s[0], w2s[0], *routing, per_row=False, scales=scales[0]).float()
            want = torch_experts(
                x.float(),
                _weights(w13s[0], scales[0], 0),
                _weights(w2s[0], scales[0], 1),
                routing[0].float(),
                routing[1],
            )
            row["grouped_max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        row["tflop_s"] = tokens * TOP_K * 3 * inter * HIDDEN * 2 / row["grouped_us"] / 1e6
        ids = fused.route(logits[0], TOP_K, True)[1]
        row["sort_us"] = time_graph(lambda: fused.align_by_expert(ids, EXPERTS, row["grouped_block_m"]))
        row["sort_torch_us"] = time_graph(
            lambda: fused.align_by_expert(ids, EXPERTS, row["grouped_block_m"], kernel=False)
        )
        if not fused.per_row_applies(tokens * TOP_K, EXPERTS):
            if args.grouped_sweep:
                row.update(_grouped_sweep(grouped, tokens, row["w8a8"]))
            results.append(row)
            print(json.dumps(row))
            continue
        want = torch_experts(
            x.float(),
            _weights(w13s[0], scales[0], 0),
            _weights(w2s[0], scales[0], 1),
            *select_experts(logits[0].float(), TOP_K, True),
        )
        got = fused._per_row(x, w13s[0], w2s[0], TOP_K, logits=logits[0], renormalize=True, scales=scales[0]).float()
        row["per_row_max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        row["per_row_us"] = time_graph(per_row) / LAYERS
        if torch.cuda.get_device_capability() >= (9, 0):  # with programmatic dependent launch (Kernels.pdl)
            row["per_row_pdl_us"] = time_graph(lambda: per_row(pdl=True)) / LAYERS
        row["per_row_routed_us"] = time_graph(per_row_routed) / LAYERS
        row["per_row_tiles"] = {"gate_up": fused.PER_ROW_GATE_UP, "down": fused.PER_ROW_DOWN}
        row["per_row_tb_s"] = nbytes / row["per_row_us"] / 1e6
        if args.sweep and tokens == args.tokens[0]:
            default = fused.PER_ROW_GATE_UP, fused.PER_ROW_DOWN
            at_once = fused.PER_ROW_DOWN_AT_ONCE
            fused.PER_ROW_DOWN_AT_ONCE = None  # the loop over choices, whose tiles the sweep tries first
            sweep = {}
            for cfg in GATE_UP:
                fused.PER_ROW_GATE_UP = cfg
                sweep[_name("gate_up", cfg)] = time_graph(per_row) / LAYERS
            fused.PER_ROW_GATE_UP = min(GATE_UP, key=lambda c: sweep[_name("gate_up", c)])
            for cfg in DOWN:
                fused.PER_ROW_DOWN = cfg
                sweep[_name("down", cfg)] = time_graph(per_row) / LAYERS
            best = fused.PER_ROW_GATE_UP, min(DOWN, key=lambda c: sweep[_name("down", c)])
            fused.PER_ROW_DOWN = best[1]
            at_once_fp8 = fused.PER_ROW_DOWN_AT_ONCE_FP8
            for cfg in DOWN_AT_ONCE:  # every choice's weights loaded at once, beside the best loop's tile
                fused.PER_ROW_DOWN_AT_ONCE = cfg
                fused.PER_ROW_DOWN_AT_ONCE_FP8 = cfg  # what e4m3 experts take (with --fp8)
                sweep[f"down at once {cfg[0]}w{cfg[1]}"] = time_graph(per_row) / LAYERS
                got = fused._per_row(
                    x, w13s[0], w2s[0], TOP_K, logits=logits[0], renormalize=True, scales=scales[0]
                ).float()
                row.setdefault("at_once_max_rel_err", {})[f"{cfg[0]}w{cfg[1]}"] = (
                    (got - want).abs().max() / want.abs().max()
                ).item()
            fused.PER_ROW_DOWN_AT_ONCE, fused.PER_ROW_DOWN_AT_ONCE_FP8 = at_once, at_once_fp8
            row["sweep_us"] = sweep
            row["best"] = {"gate_up": best[0], "down": best[1]}
            fused.PER_ROW_GATE_UP, fused.PER_ROW_DOWN = best
            row["best_us"] = time_graph(per_row) / LAYERS
            fused.PER_ROW_GATE_UP, fused.PER_ROW_DOWN = default
        results.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def _fp8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (e4m3, float32 scales [E, N, ceil(K / group)] (group 0: [E, N, 1])); the last group
    may be partial."""
    experts, rows, cols = w.shape
    width = group or cols
    groups = -(-cols // width)
    blocks = torch.nn.functional.pad(w.float(), (0, groups * width - cols)).view(experts, rows, groups, width)
    scale = (blocks.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(experts, rows, groups * width)
    return q[..., :cols].contiguous(), scale


def _weights(w: torch.Tensor, scales: ExpertScales | None, which: int) -> torch.Tensor:
    """The float32 weights w stands for (w13 with which 0, w2 with 1)."""
    if scales is None:
        return w.float()
    s, group = (scales.gate_up, scales.gate_up_group) if which == 0 else (scales.down, scales.down_group)
    cols = w.shape[-1]
    return w.float() * s.repeat_interleave(group or cols, dim=-1)[..., :cols]


def _grouped_sweep(grouped, tokens: int, w8a8: bool) -> dict:
    """Each GROUPED tile in place of the default's (fused._block_m and the tile tables patched)."""
    block_m, tiles, tiles_w8a8 = fused._block_m, dict(fused.GROUPED_TILES), dict(fused.GROUPED_TILES_W8A8)
    sweep = {}
    prefill = GROUPED_W8A8 if w8a8 else GROUPED_PREFILL
    try:
        for m, n, k, w, st in GROUPED_DECODE if tokens * TOP_K <= 32 * EXPERTS else prefill:
            fused._block_m = lambda rows, experts, m=m: m
            fused.GROUPED_TILES = fused.GROUPED_TILES_W8A8 = {m: (n, k, w, st)}
            fused._FELL_BACK.clear()
            try:
                us = time_graph(grouped) / LAYERS
            except Exception as e:  # noqa: BLE001 - a tile past the GPU's shared memory or registers
                print(f"  {m}x{n}x{k}w{w}s{st}: {type(e).__name__}", file=sys.stderr)
                continue
            if fused._FELL_BACK:  # it ran the fallback's tiles: past the GPU's shared memory or registers
                print(f"  {m}x{n}x{k}w{w}s{st}: out of resources", file=sys.stderr)
                continue
            sweep[f"{m}x{n}x{k}w{w}s{st}"] = us
    finally:
        fused._block_m, fused.GROUPED_TILES, fused.GROUPED_TILES_W8A8 = block_m, tiles, tiles_w8a8
        fused._FELL_BACK.clear()
    best = min(sweep, key=sweep.get)
    return {"grouped_sweep_us": sweep, "grouped_best": best, "grouped_best_us": sweep[best]}


if __name__ == "__main__":
    main()
