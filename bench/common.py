"""What the GPU benchmarks share: real architectures with random weights, the LLM behind the ablation
flags, GPU time per decode step and the idle gaps between steps, a kernel profile, and the output
(a short table on stdout, a JSON file)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python bench/x.py` from anywhere

from cluster import LLM  # noqa: E402
from cluster.config import SchedulerConfig  # noqa: E402
from worker.batch import BatchDesc  # noqa: E402
from worker.cublaslt import replay_median_us  # noqa: E402
from worker.kernels import (  # noqa: E402
    DECODE_GEMMS,
    DECODE_KERNELS,
    DECODE_MERGES,
    DECODE_ORDERS,
    FP8_NORMS,
    MOE_KERNELS,
    PDL_MODES,
    PREFILL_KERNELS,
    Kernels,
)

if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is None:
    # a figure taken so is not the engine's: no FlashInfer attention, hence no CUDA graphs
    print(
        "warning: a GPU but no flashinfer here: the engine runs torch attention, eagerly. On a GPU host "
        "run benchmarks through bench/gpu.sh, which puts the wheels of .whl/ on PYTHONPATH",
        file=sys.stderr,
    )

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}

# the config.json values of the released checkpoints
ARCHS = {
    "qwen3-0.6b": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B: 128 experts of width 768 a layer, 8 active; 61 GB of bf16 weights, 58 of them experts
    "qwen3-30b-a3b": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "num_hidden_layers": 48,
        "max_window_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    # for a smoke run of the scripts on a CPU
    "tiny": {
        **_QWEN3,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    },
}
ARCHS["tiny-moe"] = {  # the moe suite's smoke run on a CPU
    **ARCHS["tiny"],
    **{k: ARCHS["qwen3-30b-a3b"][k] for k in ("architectures", "model_type", "norm_topk_prob", "mlp_only_layers")},
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


def model_folder(arch: str, with_tokenizer: bool = False) -> str:
    """A temporary folder holding the architecture's config.json (weights are random) and, for the HTTP
    server, a word-level tokenizer with one token per id ("t0", "t1", ...) so any id decodes."""
    folder = Path(tempfile.mkdtemp(prefix=f"raylm-{arch}-"))
    (folder / "config.json").write_text(json.dumps(ARCHS[arch], indent=2))
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(ARCHS[arch]["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{ARCHS[arch]['eos_token_id']}").save_pretrained(
            folder
        )
    return str(folder)


def eagle3_head_folder(arch: str, draft_vocab_size: int = 32000) -> str:
    """A temporary folder holding the config.json of an EAGLE-3 head (random weights, load_format dummy)
    for the architecture, shaped as the published heads are: one Llama layer of the model's widths, an LM
    head over `draft_vocab_size` of its tokens, reading the published default layers."""
    model = ARCHS[arch]
    head = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"] if "intermediate_size" in model else 4 * model["hidden_size"],
        "num_attention_heads": model["num_attention_heads"],
        "num_key_value_heads": model["num_key_value_heads"],
        "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"],
        "num_hidden_layers": 1,
        "vocab_size": model["vocab_size"],
        "draft_vocab_size": min(draft_vocab_size, model["vocab_size"]),
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model.get("rms_norm_eps", 1e-6),
        "rope_theta": model.get("rope_theta", 1000000.0),
        "torch_dtype": "bfloat16",
    }
    layers = model["num_hidden_layers"]
    if layers < 4:  # too few for the published default (2, L / 2, L - 3)
        head["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    folder = Path(tempfile.mkdtemp(prefix=f"raylm-{arch}-eagle3-"))
    (folder / "config.json").write_text(json.dumps(head, indent=2))
    return str(folder)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-0.6b")
    parser.add_argument("--no-overlap", action="store_true", help="the normal loop instead of the overlap loop")
    parser.add_argument("--no-cuda-graph", action="store_true", help="eager decode")
    parser.add_argument("--cache", choices=["radix", "naive"], default="radix")
    parser.add_argument("--page-size", type=int, default=16)  # the server's default (ServeConfig)
    parser.add_argument("--max-running-reqs", type=int, default=256)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--no-fused", action="store_true", help="torch elementwise kernels instead of FlashInfer's fused ones"
    )
    parser.add_argument(
        "--no-triton-kernels",
        action="store_true",
        help="FlashInfer's q/k norm and rotary and a KV store instead of the Triton prologue (to compare)",
    )
    parser.add_argument(
        "--decode-kernel", choices=DECODE_KERNELS, default="auto", help="force one decode attention path (to compare)"
    )
    parser.add_argument(
        "--prefill-kernel", choices=PREFILL_KERNELS, default="auto", help="force FlashInfer's prefill backend"
    )
    parser.add_argument("--no-small-linear", action="store_true", help="cuBLAS for batch-1 linear layers too")
    parser.add_argument(
        "--no-tuned-gemms",
        action="store_true",
        help="cuBLAS's own algorithm for every linear layer (none timed at start)",
    )
    parser.add_argument(
        "--moe-kernel", choices=MOE_KERNELS, default="auto", help="torch: the loop over experts instead of Triton's"
    )
    parser.add_argument(
        "--decode-gemm",
        choices=DECODE_GEMMS,
        default="auto",
        help="linear layers above one row: the Triton GEMM at decode batches for every dtype, or cuBLAS/cuBLASLt only",
    )
    parser.add_argument(
        "--pdl",
        choices=PDL_MODES,
        default="auto",
        help="programmatic dependent launch of the steps' Triton kernels (Kernels.pdl; compute capability 9.0+)",
    )
    parser.add_argument(
        "--fp8-norms",
        choices=FP8_NORMS,
        default="auto",
        help="an FP8 model's residual norms at batch 1: a launch of their own (apart), inside its GEMVs, or "
        "inside with their weights folded into the weights quantized at load (Kernels.fp8_norms)",
    )
    parser.add_argument(
        "--decode-merge",
        choices=DECODE_MERGES,
        default="auto",
        help="the Triton decode kernel's split results merged by a launch of their own or by the last split's "
        "program (Kernels.decode_merge)",
    )
    parser.add_argument(
        "--decode-order",
        choices=DECODE_ORDERS,
        default="auto",
        help="the order the Triton decode kernel's programs start in: the batch's rows, or the longest "
        "requests first (Kernels.decode_order)",
    )
    parser.add_argument("--max-extend-tokens", type=int, help="tokens computed per step (default: the engine's)")
    parser.add_argument(
        "--no-mixed-steps", action="store_true", help="prefill-first steps (no decodes beside prompt chunks)"
    )
    parser.add_argument(
        "--extend-graph-tokens",
        type=int,
        help="largest eager step replayed from CUDA graphs; 0: none (default: the engine's)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8_e4m3"],
        default="auto",
        help="KV-cache storage: auto (bf16) or fp8_e4m3 (twice the pages for the same memory)",
    )
    parser.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: the (dummy) weights quantized at load to e4m3 per output channel (default: bf16 weights)",
    )
    parser.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --quantization fp8: the LM head e4m3 too, a scale a vocabulary row",
    )
    parser.add_argument(
        "--speculative-method",
        choices=["ngram", "draft", "eagle3"],
        help="speculative decoding (default: off); draft: a draft with the model's own (dummy) weights; "
        "eagle3: a random EAGLE-3 head of the model's widths",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)


def kernels_of(args: argparse.Namespace) -> Kernels:
    """The kernels the flags ask for (by default the engine's automatic choices)."""
    return Kernels(
        fused=not args.no_fused,
        triton=not args.no_triton_kernels,
        small_linear=not args.no_small_linear,
        tuned_gemms=not args.no_tuned_gemms,
        decode=args.decode_kernel,
        prefill=args.prefill_kernel,
        moe=args.moe_kernel,
        decode_gemm=args.decode_gemm,
        pdl=args.pdl,
        fp8_norms=args.fp8_norms,
        decode_merge=args.decode_merge,
        decode_order=args.decode_order,
    )


def make_llm(args: argparse.Namespace) -> LLM:
    return LLM(
        model_folder(args.arch),
        kernels=kernels_of(args),
        tp_size=args.tp_size,
        dtype="bfloat16",
        load_format="dummy",
        page_size=args.page_size,
        cache_type=args.cache,
        max_running_reqs=args.max_running_reqs,
        overlap=not args.no_overlap,
        cuda_graph_max_bs=0 if args.no_cuda_graph else 256,
        kv_cache_dtype=args.kv_cache_dtype,
        mixed_steps=not args.no_mixed_steps,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        **speculation_of(args),
        # the engine's default unless asked: a benchmark "at the defaults" measures what users run
        **({"max_extend_tokens": args.max_extend_tokens} if args.max_extend_tokens is not None else {}),
        **({"extend_graph_tokens": args.extend_graph_tokens} if args.extend_graph_tokens is not None else {}),
    )


def speculation_of(args: argparse.Namespace) -> dict:
    """The speculative-decoding settings the flags ask for (none by default)."""
    method = getattr(args, "speculative_method", None)
    if method is None:
        return {}
    spec = dict(speculative_method=method, num_speculative_tokens=args.num_speculative_tokens)
    if method == "draft":
        spec["speculative_model"] = model_folder(args.arch)
    elif method == "eagle3":
        spec["speculative_model"] = eagle3_head_folder(args.arch)
    return spec


def resolved_kernels(llm: LLM) -> dict:
    """What the engine resolved its automatic kernel choices to (programmatic dependent launch by the
    model), beside the flags' asks in config_of; nothing where no engine runs in this process (tp > 1)."""
    engine = getattr(llm, "engine", None)
    return {} if engine is None else {"pdl_resolved": engine.kernels.pdl}


def config_of(args: argparse.Namespace) -> dict:
    return {
        "arch": args.arch,
        "tp_size": args.tp_size,
        "fused": not args.no_fused,
        "triton_kernels": not args.no_triton_kernels,
        "decode_kernel": args.decode_kernel,
        "prefill_kernel": args.prefill_kernel,
        "small_linear": not args.no_small_linear,
        "tuned_gemms": not args.no_tuned_gemms,
        "moe_kernel": args.moe_kernel,
        "decode_gemm": args.decode_gemm,
        "pdl": args.pdl,
        "fp8_norms": args.fp8_norms,
        "decode_merge": args.decode_merge,
        "decode_order": args.decode_order,
        "overlap": not args.no_overlap,
        "cuda_graph": not args.no_cuda_graph,
        "cache": args.cache,
        "page_size": args.page_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "quantize_lm_head": args.quantize_lm_head,
        "speculative_method": getattr(args, "speculative_method", None),
        "mixed_steps": not args.no_mixed_steps,
        "max_extend_tokens": args.max_extend_tokens
        if args.max_extend_tokens is not None
        else SchedulerConfig().max_extend_tokens,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
    }


class StepTimer:
    """CUDA events at the start (once the step's metadata has arrived) and end of every step on the
    compute stream; attach with `engine.step_timer = StepTimer()`."""

    def __init__(self) -> None:
        self.steps: list[tuple[bool, torch.cuda.Event, torch.cuda.Event | None]] = []
        # per step: whether the device had already finished the step before when the host reached this
        # one's launch (a gap the host caused; otherwise the gap is the device's own, between streams)
        self.late: list[bool] = []
        # per step: the scheduler stream's events around its part (metadata copies, page table, plan)
        self.sched: list[list[torch.cuda.Event] | None] = []
        self._sched: list[torch.cuda.Event] | None = None  # the events of the step being launched

    def sched_begin(self, stream: torch.cuda.Stream) -> None:
        if torch.cuda.is_available():
            self._sched = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self._sched[0].record(stream)

    def sched_end(self, stream: torch.cuda.Stream) -> None:
        if torch.cuda.is_available():
            self._sched[1].record(stream)

    def begin(self, stream: torch.cuda.Stream, desc: BatchDesc) -> None:
        if not torch.cuda.is_available():
            return
        self.sched.append(self._sched)
        prev = self.steps[-1][2] if self.steps else None
        self.late.append(prev is not None and prev.query())
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self.steps.append((desc.is_prefill, start, None))

    def end(self, stream: torch.cuda.Stream) -> None:
        if not self.steps:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        is_prefill, start, _ = self.steps[-1]
        self.steps[-1] = (is_prefill, start, end)

    def phase_summary(self) -> dict:
        """GPU time of every step by kind over the run: extend steps (prompt chunks, with the decodes
        beside them in a mixed step) and decode-only steps, each step from its start to its end on the
        compute stream."""
        if not self.steps:
            return {}
        torch.cuda.synchronize()
        extend = [s.elapsed_time(e) for p, s, e in self.steps if p and e is not None]
        decode = [s.elapsed_time(e) for p, s, e in self.steps if not p and e is not None]
        first, last = self.steps[0][1], self.steps[-1][2]
        return {
            "extend_steps": len(extend),
            "extend_gpu_ms_total": sum(extend),
            "extend_step_ms_median": statistics.median(extend) if extend else None,
            "decode_steps_all": len(decode),
            "decode_gpu_ms_total": sum(decode),
            "steps_span_ms": first.elapsed_time(last) if last is not None else None,
        }

    def decode_summary(self) -> dict:
        """GPU time of decode steps, and the compute stream's idle gap between consecutive decode
        steps as a share of their time (the median and the total over the run)."""
        if not self.steps:
            return {}
        torch.cuda.synchronize()
        busy, idle, ratios, late_idle, late = [], [], [], [], 0
        chain, chain_start, chain_end = [], [], []
        for (p0, s0, e0), (p1, s1, _), was_late, sched in zip(
            self.steps, self.steps[1:], self.late[1:], self.sched[1:]
        ):
            if p0 or p1:
                continue
            if sched is not None:
                # the next step's scheduler-stream part: how long it ran, and when it began and ended
                # against the end of this step (positive: after it, so the compute stream waited)
                chain.append(sched[0].elapsed_time(sched[1]))
                chain_start.append(e0.elapsed_time(sched[0]))
                chain_end.append(e0.elapsed_time(sched[1]))
            step_ms, gap_ms = s0.elapsed_time(e0), e0.elapsed_time(s1)
            busy.append(step_ms)
            idle.append(gap_ms)
            ratios.append(gap_ms / step_ms)
            if was_late:
                late += 1
                late_idle.append(gap_ms)
        if not busy:
            return {}
        return {
            "decode_steps": len(busy),
            "decode_step_ms_median": statistics.median(busy),
            "idle_gap_ms_median": statistics.median(idle),
            "idle_pct_of_step_median": 100 * statistics.median(ratios),
            "idle_pct_of_step_total": 100 * sum(idle) / sum(busy),
            # steps the host launched only after the device had run out of work, and their share of
            # the idle time: what a faster host would remove
            "host_late_pct_of_steps": 100 * late / len(busy),
            "idle_pct_host_late": 100 * sum(late_idle) / (sum(idle) or 1),
            **(
                {
                    "sched_part_ms_median": statistics.median(chain),
                    "sched_part_start_after_step_end_ms_median": statistics.median(chain_start),
                    "sched_part_end_after_step_end_ms_median": statistics.median(chain_end),
                }
                if chain
                else {}
            ),
        }


class Sections:
    """Host wall time of named methods (wrapped on their objects for the duration, so nothing else is
    slowed as a profiler would), summed over the calls: `add(name, obj, attr)`, then `summary(steps)`
    gives microseconds per step. Nested sections count inside their parents too."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._wrapped: list[tuple[object, str]] = []

    def add(self, name: str, obj: object, attr: str) -> None:
        if obj is None or not hasattr(obj, attr):
            return
        inner = getattr(obj, attr)
        self.total.setdefault(name, 0.0)
        self.calls.setdefault(name, 0)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(obj, attr, timed)
        self._wrapped.append((obj, attr))

    def remove(self) -> None:
        for obj, attr in reversed(self._wrapped):
            try:
                delattr(obj, attr)  # the class's method again
            except AttributeError:
                pass
        self._wrapped.clear()

    def summary(self, steps: int) -> dict[str, dict[str, float]]:
        return {
            name: {"us_per_step": 1e6 * t / max(steps, 1), "calls_per_step": self.calls[name] / max(steps, 1)}
            for name, t in self.total.items()
        }


class ProfileWindow:
    """Profiles the kernels of decode (or extend) steps first..first+count (as an engine step hook, like StepTimer)."""

    def __init__(self, first: int = 200, count: int = 50, trace: str | None = None, extend: bool = False) -> None:
        """`trace`: also write the window's host and device timeline there (Chrome trace JSON, gzipped
        when the name ends in .gz) for a look at what the host does between launches. `extend`: count
        extend steps (prompt chunks, mixed steps) instead of decode steps."""
        from torch.profiler import ProfilerActivity, profile

        self.first, self.last = first, first + count
        self.seen = 0
        self.trace = trace
        self.extend = extend
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=trace is not None)

    def sched_begin(self, stream: torch.cuda.Stream) -> None:
        pass

    def sched_end(self, stream: torch.cuda.Stream) -> None:
        pass

    def begin(self, stream: torch.cuda.Stream, desc: BatchDesc) -> None:
        if desc.is_prefill != self.extend:
            return
        self.seen += 1
        if self.seen == self.first:
            self.prof.start()

    def end(self, stream: torch.cuda.Stream) -> None:
        if self.seen == self.last:
            torch.cuda.synchronize()
            self.prof.stop()
            self.seen += 1  # stop once
            if self.trace:
                self.prof.export_chrome_trace(self.trace)

    def top_kernels(self, top: int = 25) -> list[dict]:
        """The kernels that took the most GPU time in the window, with their share of it (a run shorter
        than the window: the steps it had; none: no kernels)."""
        if self.seen < self.first:
            return []
        if self.seen <= self.last:  # the run ended inside the window
            torch.cuda.synchronize()
            self.prof.stop()
            self.seen = self.last + 1
        # kernels only: a CPU op's row repeats the device time of the kernels it launched
        events = [
            e
            for e in self.prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
        ]
        total = sum(e.self_device_time_total for e in events) or 1
        return [
            {
                "kernel": e.key[:100],
                "calls": e.count,
                "ms": e.self_device_time_total / 1e3,
                "pct": 100 * e.self_device_time_total / total,
            }
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]
        ]


# Qwen3-8B's linear layers, (K, N) each: what the FP8 benchmarks time
QWEN3_8B_LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
# each architecture's linear layers, (K, N)
LINEARS = {
    "qwen3-8b": QWEN3_8B_LINEARS,
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
}


def fp8_weights(n: int, k: int, copies: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`copies` random e4m3 weights [n, k] on the GPU (distinct, so that L2 holds none of them across a
    graph's copies) and one per-channel scale [n, 1] for them."""
    weights = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
    return weights, torch.rand(n, 1, device="cuda") * 0.01 + 0.005


def time_graph(fn, reps: int = 20, calls: int = 1) -> float:
    """Median microseconds of one of `calls` calls of fn, over `reps` replays of one CUDA graph holding them
    (fn runs once first outside the capture: it compiles, plans and allocates there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    return replay_median_us(graph, reps, calls)


@dataclass
class TokenArrivals:
    """One `generate` with each request's token arrivals stamped on the host, and the speculative tokens
    proposed and kept over it."""

    outputs: list
    arrivals: dict[int, list[float]]  # by request: when each of its tokens reached the scheduler's output
    drafted: int
    accepted: int
    # rows launched on a verify step still in flight (speculation's pipeline), and of them those void
    pipelined: int = 0
    void: int = 0

    @property
    def ms_per_token(self) -> float:
        """The median over requests of the time from its first token to its last over the tokens after
        the first (its decode, prefill excluded)."""
        return statistics.median(1e3 * (t[-1] - t[0]) / (len(t) - 1) for t in self.arrivals.values() if len(t) > 1)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def token_arrivals(llm: LLM, prompts: list[list[int]], params) -> TokenArrivals:
    sched = llm.scheduler
    collect, arrivals = sched.on_output, {}

    def on_output(deltas):
        now = time.perf_counter()
        for d in deltas:
            if d.token is not None:
                arrivals.setdefault(d.uid, []).append(now)
        collect(deltas)

    sched.on_output = on_output
    before = sched.snapshot()
    spec = sched.spec
    rows = (spec.num_pipelined_rows, spec.num_void_rows) if spec is not None else (0, 0)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        sched.on_output = collect
    after = sched.snapshot()
    return TokenArrivals(
        outputs,
        arrivals,
        after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        spec.num_pipelined_rows - rows[0] if spec is not None else 0,
        spec.num_void_rows - rows[1] if spec is not None else 0,
    )


def report(result: dict, out: str | None, table: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in table)
    for key, value in table:
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
