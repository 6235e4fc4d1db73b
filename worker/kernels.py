"""Which kernels an engine runs where several compute the same thing: one frozen record that the engine
hands to its model's layers, its KV cache, its sampler and its attention backend when it builds them,
so that two engines in one process can differ. Not a user's setting: every default is the automatic
choice, and benchmarks and tests pass others (`LLM(path, kernels=Kernels(fused=False))`) to compare."""

from __future__ import annotations

from dataclasses import dataclass, replace

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
DECODE_KERNELS = ("auto", "tensor_cores", "cuda_cores", "triton", "triton_steps")
PREFILL_KERNELS = ("auto", "fa2", "fa3")
MOE_KERNELS = ("auto", "torch")
DECODE_GEMMS = ("auto", "vendor", "triton")
PDL_MODES = ("auto", "on", "off")
DECODE_MERGES = ("auto", "launch", "last")
DECODE_ORDERS = ("auto", "rows", "longest_first", "sorted_rows")
FP8_NORMS = ("auto", "apart", "inside", "folded")
# What `fp8_norms` auto resolves to. Qwen3-8B with FP8 weights at batch 1 on an H100 (bench/gpu.sh fp8_norms,
# 2026-12-06, ms a token): apart 3.476, inside 3.564 (the norm in the GEMV costs registers: 87 against 47),
# folded 3.358 (bf16 5.451). For a checkpoint quantized already auto is apart (`Kernels.with_weights`): nothing
# folds there, so folded would be inside
FP8_NORMS_AUTO = "folded"
# What `decode_order` auto resolves to. On an H100 (2026-12-06, bench/gpu.sh decode_order, Qwen3-0.6B's
# heads): the kernel alone at 256 / 128 / 64 rows (lengths 150..1600), us, over bf16 308.7 / 152.2 / 84.8
# against 319.4 / 162.6 / 88.2 in row order, over fp8 182.0 / 91.9 / 57.4 against 186.3 / 99.3 / 59.4; (a)
# over an fp8 cache 29,638 output tok/s against 29,171 (decode steps' GPU time 4,545 ms against 4,625)
DECODE_ORDER_AUTO = "longest_first"
# Where `pdl` auto turns programmatic dependent launch on: every model on one GPU. Batch 1 on an H100
# (bench/decode_latency.py --pdl off / on, e61451b, 2026-12-05, ms a token): Qwen3-0.6B 0.963 / 0.896,
# Qwen3-8B 5.740 / 5.558, with FP8 weights 3.669 / 3.476, Qwen3-30B-A3B 3.216 / 2.975. (Before its GEMVs'
# prefetch was limited to small weights, triton_ops.prefetch_programs, the wide models lost 0.5-8% with
# it.) Tensor parallelism is not measured: the all-reduce's kernels sit between the step's launches


@dataclass(frozen=True)
class Kernels:
    # FlashInfer's fused RMSNorm (with the residual add), rotary embedding and SiLU-and-multiply on CUDA in
    # half precision; off: the torch versions
    fused: bool = True
    # the Triton attention prologue on CUDA (q/k norm, rotary and the KV write in one launch); off:
    # FlashInfer's norm and rotary kernels and the Triton KV store. Triton's sampler and KV store run on
    # CUDA regardless
    triton: bool = True
    # a Triton matrix-vector kernel for linear layers at batch 1 on CUDA; off: cuBLAS. With `fused` too, a
    # narrow row's residual norm and SiLU-and-multiply run inside it (worker/layers/row_fusion.py)
    small_linear: bool = True
    # auto: FlashInfer on a GPU in half precision, torch otherwise
    attention: str = "auto"
    # decode attention over FlashInfer's pages. auto: over an fp8 cache the Triton split-KV kernel (where
    # the GPU converts fp8); over half precision the Triton kernel in every pure decode step on Hopper, and a
    # mixed step's decode rows (every step on older GPUs) on it at and below TENSOR_CORE_ABOVE_BATCH rows
    # and on FlashInfer's tensor-core path above (worker/attention/flashinfer_backend.py); triton_steps:
    # auto's every-step rule on any GPU; the others force one (cuda_cores: FlashInfer's CUDA-core kernels at
    # every size)
    decode: str = "auto"
    # prefill (extend) attention over FlashInfer's pages. auto: see prefill_backend in
    # worker/attention/flashinfer_backend.py; fa2 or fa3 force FlashInfer's backend of that name (fa3 only
    # where it builds: Hopper, a half-precision cache)
    prefill: str = "auto"
    # mixture-of-experts blocks. auto: the fused Triton kernels (device-side routing, token sort, grouped
    # GEMMs; CUDA-graph safe) on CUDA where Triton is installed, and on the CPU under Triton's interpreter
    # with interpret_on_cpu; the torch loop over experts otherwise, or always with torch
    moe: str = "auto"
    # linear layers above one row on CUDA (bf16, and FP8 with per-channel scales). triton: the Triton GEMM
    # of worker/skinny_gemm.py at decode batches where it pays (skinny_gemm.pays), cuBLAS or cuBLASLt
    # elsewhere; auto: the same for the weight dtypes of skinny_gemm.AUTO_DTYPES (e4m3), vendor for the others;
    # vendor: cuBLAS and cuBLASLt at every row count
    decode_gemm: str = "auto"
    # the half-precision linear layers that reach cuBLAS at the CUDA graphs' batch sizes run through cuBLASLt
    # at the algorithm the engine timed fastest for their shape at start, where it beat cuBLAS's own pick
    # (worker/cublaslt.py); off: cuBLAS's pick (F.linear) always
    tuned_gemms: bool = True
    # programmatic dependent launch (compute capability 9.0+) of a step's Triton kernels: each may start
    # while the kernel before it finishes, its weights prefetched into L2 meanwhile (worker/pdl_kernels.py).
    # auto: on where it was measured faster (`with_model`: on one GPU), off elsewhere and wherever no engine
    # resolved it
    pdl: str = "auto"
    # the residual norms before an FP8 model's qkv and gate-up at batch 1 (worker/layers/row_fusion.py,
    # rms_fuses). apart: a norm launch of its own (the residual add in it); inside: the residual add in the
    # epilogue of the GEMV before (o, down) and the norm inside the FP8 GEMV after, in its one pass over the
    # row; folded: as inside, and where the weights are quantized at load the norm's weight folded into
    # them first (worker/quant/fold.py), so the GEMV reads nothing the plain GEMV does not (a checkpoint
    # quantized already is not folded: there folded is inside). auto: FP8_NORMS_AUTO where the weights are
    # quantized at load, apart for a checkpoint quantized already (`with_weights`)
    fp8_norms: str = "auto"
    # how the Triton decode kernel's split results merge (worker/triton_decode.py). launch: a merge kernel
    # after the splits; last: in the program of a request's kv head's last split to finish, with no launch
    # of its own; auto: last where a kv head has at most triton_decode.MERGE_IN_LAST_MAX_GROUP query heads
    decode_merge: str = "auto"
    # the order in which the Triton decode kernel's programs start (worker/triton_decode.py's `order`).
    # rows: the batch's row order; longest_first: every kv head of the request with the longest KV first,
    # so that a long request's programs do not start last and hold a few multiprocessors after the rest are
    # idle (the result is the same bit for bit; steps of more than TENSOR_CORE_ABOVE_BATCH rows, whose
    # programs outnumber what the GPU holds at once); sorted_rows: the scheduler puts a decode step's rows
    # in that order (longest KV first), so every attention kernel, FlashInfer's too, starts them so and the
    # Triton kernel runs in row order; auto: DECODE_ORDER_AUTO
    decode_order: str = "auto"
    # every Triton kernel also on CPU tensors, under Triton's interpreter (TRITON_INTERPRET=1 before
    # Triton is imported), with `triton` on: how the tests check them against the torch paths; far too
    # slow to serve with
    interpret_on_cpu: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; choose {', '.join(ATTENTION_BACKENDS)}")
        if self.decode not in DECODE_KERNELS:
            raise ValueError(f"unknown decode kernel {self.decode!r}; choose {', '.join(DECODE_KERNELS)}")
        if self.prefill not in PREFILL_KERNELS:
            raise ValueError(f"unknown prefill kernel {self.prefill!r}; choose {', '.join(PREFILL_KERNELS)}")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ValueError(f"unknown decode GEMM {self.decode_gemm!r}; choose {', '.join(DECODE_GEMMS)}")
        if self.moe not in MOE_KERNELS:
            raise ValueError(f"unknown MoE kernel {self.moe!r}; choose {', '.join(MOE_KERNELS)}")
        if self.fp8_norms not in FP8_NORMS:
            raise ValueError(f"unknown FP8 norm placement {self.fp8_norms!r}; choose {', '.join(FP8_NORMS)}")
        if self.decode_merge not in DECODE_MERGES:
            raise ValueError(f"unknown decode merge {self.decode_merge!r}; choose {', '.join(DECODE_MERGES)}")
        if self.decode_order not in DECODE_ORDERS:
            raise ValueError(f"unknown decode order {self.decode_order!r}; choose {', '.join(DECODE_ORDERS)}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"unknown programmatic dependent launch mode {self.pdl!r}; choose {', '.join(PDL_MODES)}")

    def with_model(self, tp_size: int) -> Kernels:
        """These kernels with `pdl` auto resolved for a model (an engine's, before it builds its layers):
        on where it runs on one GPU."""
        if self.pdl != "auto":
            return self
        on = tp_size == 1
        return replace(self, pdl="on" if on else "off")

    def with_weights(self, quantized_at_load: bool) -> Kernels:
        """These kernels with `fp8_norms` auto resolved for the model's weights (an engine's, before it
        builds its layers): FP8_NORMS_AUTO where they are quantized at load, apart for a checkpoint
        quantized already (where folded would be inside, which was measured slower than apart)."""
        if self.fp8_norms != "auto":
            return self
        return replace(self, fp8_norms=FP8_NORMS_AUTO if quantized_at_load else "apart")

    @property
    def decode_longest_first(self) -> bool:
        """Whether the Triton decode kernel starts the longest requests' programs first (decode_order)."""
        return self._decode_order == "longest_first"

    @property
    def sorts_decode_rows(self) -> bool:
        """Whether the scheduler puts a decode step's rows longest KV first (decode_order sorted_rows)."""
        return self._decode_order == "sorted_rows"

    @property
    def _decode_order(self) -> str:
        return DECODE_ORDER_AUTO if self.decode_order == "auto" else self.decode_order

    @property
    def fp8_norms_resolved(self) -> str:
        """fp8_norms with auto resolved (FP8_NORMS_AUTO)."""
        return FP8_NORMS_AUTO if self.fp8_norms == "auto" else self.fp8_norms

    @property
    def fp8_norms_inside(self) -> bool:
        """Whether an FP8 model's residual norms run inside its GEMVs at batch 1 (fp8_norms inside or folded)."""
        return self.fp8_norms_resolved in ("inside", "folded")
