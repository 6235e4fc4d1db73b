"""Which kernels an engine runs where several compute the same thing: one frozen record that the engine
hands to its model's layers, its KV cache, its sampler and its attention backend when it builds them,
so that two engines in one process can differ. Not a user's setting: every default is the automatic
choice, and benchmarks and tests pass others (`LLM(path, kernels=Kernels(fused=False))`) to compare."""

from __future__ import annotations

from dataclasses import dataclass, replace

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
DECODE_KERNELS = ("auto", "tensor_cores", "cuda_cores", "triton")
PREFILL_KERNELS = ("auto", "fa2", "fa3")
MOE_KERNELS = ("auto", "torch")
DECODE_GEMMS = ("auto", "vendor", "triton")
PDL_MODES = ("auto", "on", "off")
# The widest hidden size at which `pdl` auto turns programmatic dependent launch on. Batch 1 on an H100
# (bench/decode_latency.py --pdl, 8700eb9, 2026-12-05, ms a token, two alternated pairs): Qwen3-0.6B
# (1,024) 0.886 and 0.883 with it against 0.959 and 0.960; Qwen3-8B (4,096) 6.280 and 6.278 against 5.817
# and 5.816. Earlier (53fe163) the mixture of experts (2,048) and Qwen3-8B with FP8 weights lost 1.5% and
# 0.5%. Where a layer's launches are short, it hides their launch and ramp; where they read hundreds of MB,
# the next kernel's programs waiting on the GPU beside them cost more than that. (a) over the 0.6B moved
# within its noise (bf16 20,145 against 19,898, fp8 cache 28,103 against 28,373; one run each)
PDL_MAX_HIDDEN = 1024


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
    # the GPU converts fp8); over half precision the Triton kernel at and below TENSOR_CORE_ABOVE_BATCH rows
    # (worker/attention/flashinfer_backend.py) and FlashInfer's tensor-core path above; the others force one
    # (cuda_cores: FlashInfer's CUDA-core kernels at every size)
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
    # programmatic dependent launch (compute capability 9.0+) of a step's Triton kernels: each may start
    # while the kernel before it finishes, its weights prefetched into L2 meanwhile (worker/pdl_kernels.py).
    # auto: on where it was measured faster (`with_model`: a dense model with unquantized weights of hidden
    # size up to PDL_MAX_HIDDEN on one GPU), off elsewhere and wherever no engine resolved it
    pdl: str = "auto"
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
        if self.pdl not in PDL_MODES:
            raise ValueError(f"unknown programmatic dependent launch mode {self.pdl!r}; choose {', '.join(PDL_MODES)}")

    def with_model(self, hidden_size: int, dense: bool, quantized: bool, tp_size: int) -> Kernels:
        """These kernels with `pdl` auto resolved for a model (an engine's, before it builds its layers):
        on for a dense model of unquantized weights and hidden size up to PDL_MAX_HIDDEN on one GPU."""
        if self.pdl != "auto":
            return self
        on = dense and not quantized and tp_size == 1 and hidden_size <= PDL_MAX_HIDDEN
        return replace(self, pdl="on" if on else "off")
