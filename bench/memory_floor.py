"""The memory floor of a workload's decode: the bytes each decode step must read from HBM (the weights its
tokens touch, the KV cache of every running request), summed over the steps the workload's output
lengths make, at a given bandwidth. A bound, not a model: launches and every kernel's own inefficiency
come on top. With --tflops each step is also bounded by its arithmetic (the larger of the two: a
roofline), and the prompts' prefill arithmetic is counted at that rate: the whole workload is bounded by
the larger of the decode's floor and all of the arithmetic (steps that mix prompt tokens into decode rows
can hide the one in the other), and by their sum where no step mixes them. The LM head stays bf16 with
--weight-bytes 1, as an FP8 engine keeps it; FP8's rate (--tflops) applies to all of the arithmetic,
bf16 attention included, so the bound is optimistic there. For a mixture of experts the weights a step touches depend on the batch: b
tokens choosing k of E experts uniformly touch E * (1 - (1 - k/E)^b) experts a layer on average, nearly
all of them from a few dozen tokens on, so a decode step costs nearly the whole expert weights until the
batch is small, and the floor of a workload whose batch shrinks as requests finish lies well below
batch 256's tokens per second.

    python bench/memory_floor.py --arch qwen3-30b-a3b [--workload default] [--tb-s 4.3] [--tflops 790]
        [--weight-bytes 1] [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np
import torch
from common import ARCHS
from offline_throughput import WORKLOADS, workload

from worker.kv_cache import KVCachePool


@dataclass(frozen=True)
class StepCost:
    """What one decode step reads: fixed weights (attention, dense MLPs, norms, the LM head), experts'
    weights per expert per layer, and KV cache per token of context; and what it computes."""

    fixed: float
    per_expert: float
    experts: int
    top_k: int
    moe_layers: int
    kv_per_token: float
    # the arithmetic: multiply-adds a token of the linears it runs (the experts it picks, the LM head: a prompt
    # runs the head at its last token only) and of attention a token of context (QK and PV over every
    # layer's query heads)
    macs_per_token: float = 0.0
    lm_head_macs: float = 0.0
    attention_macs_per_context: float = 0.0


def step_cost(cfg: dict, weight_bytes: float = 2, kv_dtype: torch.dtype = torch.bfloat16) -> StepCost:
    """An architecture's StepCost with its layers' weights at `weight_bytes` a weight (FP8: 1) and the LM
    head in bf16 (as an FP8 engine keeps it)."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    lm_head = cfg["vocab_size"] * hidden
    experts = cfg.get("num_experts", 0)
    if experts:
        per_expert = 3 * hidden * cfg["moe_intermediate_size"]
        dense_mlp, moe_layers = hidden * experts, layers  # the router's weights
    else:
        per_expert, dense_mlp, moe_layers = 0, 3 * hidden * cfg["intermediate_size"], 0
    active = layers * (attention + dense_mlp) + lm_head + layers * cfg.get("num_experts_per_tok", 0) * per_expert
    return StepCost(
        fixed=weight_bytes * layers * (attention + dense_mlp) + 2 * lm_head,
        per_expert=weight_bytes * per_expert,
        experts=experts,
        top_k=cfg.get("num_experts_per_tok", 0),
        moe_layers=moe_layers,
        kv_per_token=KVCachePool.bytes_per_page(layers, 1, cfg["num_key_value_heads"], head_dim, kv_dtype),
        macs_per_token=active,
        lm_head_macs=lm_head,
        attention_macs_per_context=2 * layers * q,
    )


def decode_floor(
    b: StepCost, prompt_lens: np.ndarray, output_lens: np.ndarray, bandwidth: float, flops: float | None = None
) -> dict:
    """Every request decoding from the first step (the whole workload admitted at once), one token a step;
    with `flops` (a second's multiply-adds times two) each step takes the longer of its bytes and its
    arithmetic."""
    seconds, expert_s, kv_s, compute_s, compute_bound = 0.0, 0.0, 0.0, 0.0, 0
    for step in range(int(output_lens.max())):
        alive = output_lens > step
        batch = int(alive.sum())
        touched = b.experts * (1 - (1 - b.top_k / b.experts) ** batch) if b.experts else 0.0
        context = float((prompt_lens[alive] + step).sum())
        kv = context * b.kv_per_token
        experts = touched * b.per_expert * b.moe_layers
        memory = (b.fixed + experts + kv) / bandwidth
        arithmetic = 2 * (batch * b.macs_per_token + context * b.attention_macs_per_context) / flops if flops else 0.0
        seconds += max(memory, arithmetic)
        compute_s += arithmetic
        compute_bound += arithmetic > memory
        expert_s += experts / bandwidth
        kv_s += kv / bandwidth
    tokens = int(output_lens.sum())
    return {
        "output_tokens": tokens,
        "decode_steps": int(output_lens.max()),
        "floor_s": seconds,
        "experts_s": expert_s,
        "kv_s": kv_s,
        "compute_s": compute_s,
        "compute_bound_steps": compute_bound,
        "floor_tok_s": tokens / seconds,
    }


def prefill_floor(b: StepCost, prompt_lens: np.ndarray, flops: float) -> float:
    """Seconds of the prompts' arithmetic at `flops`: each token's linears (the LM head at a prompt's last
    token only) and its causal attention over the tokens before it (the weights' bytes, read once a chunk,
    are small beside it)."""
    tokens = float(prompt_lens.sum())
    causal_context = float((prompt_lens * (prompt_lens + 1) / 2).sum())
    linears = tokens * (b.macs_per_token - b.lm_head_macs) + len(prompt_lens) * b.lm_head_macs
    return 2 * (linears + causal_context * b.attention_macs_per_context) / flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3-30b-a3b", choices=sorted(ARCHS))
    p.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    p.add_argument("--tb-s", type=float, default=4.3, help="HBM bandwidth, TB/s (an H200 copies at about 4.3)")
    p.add_argument(
        "--tflops",
        type=float,
        help="the tensor cores' rate, TFLOP/s (an H200 multiplies bf16 at about 790): each step is bounded by its "
        "arithmetic too, and the prefill is added",
    )
    p.add_argument("--weight-bytes", type=float, default=2, help="bytes a weight (1: FP8)")
    p.add_argument("--kv-cache-dtype", choices=["bf16", "fp8_e4m3"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = ARCHS[args.arch]
    n = WORKLOADS[args.workload][0]
    prompts, params = workload(n, args.seed, cfg["vocab_size"], args.workload)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    b = step_cost(cfg, args.weight_bytes, kv_dtype)
    flops = args.tflops * 1e12 if args.tflops else None
    prompt_lens = np.array([len(x) for x in prompts])
    report = {
        "arch": args.arch,
        "workload": args.workload,
        "tb_s": args.tb_s,
        "tflops": args.tflops,
        "weight_bytes": args.weight_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        **decode_floor(b, prompt_lens, np.array([x.max_tokens for x in params]), args.tb_s * 1e12, flops),
    }
    if flops:
        # a step may mix prompt tokens into decode rows (mixed steps): the prompts' arithmetic can then fill
        # the decode steps' memory-bound time, and the bound is the larger of the decode's own floor and all
        # of the arithmetic; run one after the other (no mixing), the two add up
        prefill = prefill_floor(b, prompt_lens, flops)
        report["prefill_s"] = prefill
        report["workload_floor_tok_s"] = report["output_tokens"] / max(report["floor_s"], report["compute_s"] + prefill)
        report["unmixed_floor_tok_s"] = report["output_tokens"] / (report["floor_s"] + prefill)
    full = b.fixed + b.per_expert * b.experts * b.moe_layers
    report["batch_256_step_weights_gb"] = full / 1e9
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
