"""The engine's configuration: which model, on what device, with how much KV cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"                 # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"                # auto: cuda when available
    page_size: int = 1
    num_pages: int | None = None        # None: from the memory budget below
    max_running_reqs: int = 256
    max_seq_len: int | None = None      # None: the model's max_position_embeddings
    load_format: str = "auto"           # auto (safetensors) or dummy (random weights)
    attention_backend: str = "auto"     # auto, torch or flashinfer
    gpu_memory_utilization: float = 0.85  # share of the GPU's memory for weights, KV cache and activations
    cpu_kv_cache_gb: float = 2.0        # KV-cache budget on the CPU
    cuda_graph_max_bs: int = 256        # 0 turns CUDA graphs off
    fused_kernels: bool = True          # FlashInfer's fused norm/rope/activation on CUDA in half precision
    triton_kernels: bool = False        # Triton attention prologue and sampler (not yet measured on a GPU)
    seed: int = 0                       # for dummy weights
