"""The engine's configuration: which model, on what device, with how much KV cache.

Every field is declared with `setting(default, help, ...)`. Its help text and allowed values are what
the `launch.py` flag shows, what flags, YAML files and `LLM(...)` keywords are checked against
(cluster/config.py) and what the README's Configure table says. A new option is one more line in the
same form; nothing else needs to change for it to be a flag, a YAML key and an `LLM` keyword.

One field is no setting: `kernels` (worker/kernels.py), which kernels run where several compute the
same thing; benchmarks and tests choose them to compare (`LLM(path, kernels=...)`), users never need to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.kernels import Kernels

# the architectures of EAGLE-3 draft heads as published (worker/models/eagle3.py), named here where the
# settings' checks read them without the model code
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence | None = None,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    unset: str | None = None,
    name: str | None = None,
    group: str | None = None,
) -> Any:
    """A dataclass field that carries its own documentation and allowed values.

    choices: the values allowed; at_least / above / at_most: bounds on a number; unset: what a None
    (or empty) default means, shown as the default; name: the key in flags, YAML and keywords when it
    is not the field's name; group: the heading it is listed under (default: its dataclass's)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "choices": tuple(choices) if choices else None,
            "at_least": at_least,
            "above": above,
            "at_most": at_most,
            "unset": unset,
            "name": name,
            "group": group,
        },
    )


@dataclass
class EngineConfig:
    model_path: str = setting(
        "",
        "a local Hugging Face model folder, or a Hugging Face id (fetched by launch.py)",
        name="model",
        unset="required",
    )
    dtype: str = setting(
        "auto",
        "weights and KV cache; auto: the checkpoint's dtype on a GPU, float32 on a CPU",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = setting("auto", "auto: cuda when available", choices=("auto", "cuda", "cpu"))
    page_size: int = setting(16, "tokens per KV-cache page", at_least=1)
    num_pages: int | None = setting(None, "KV-cache size in pages", at_least=1, unset="from the memory budget")
    kv_cache_dtype: str = setting(
        "auto",
        "KV-cache storage; auto: the model's dtype; fp8_e4m3: 8-bit floats (half "
        "the memory of bfloat16, so twice the tokens)",
        choices=("auto", "fp8_e4m3"),
    )
    quantization: str | None = setting(
        None,
        "fp8: an unquantized checkpoint's linear weights (or dummy ones) quantized at load to e4m3 per "
        "output channel, activations per token as they run; FP8 checkpoints load as published without it",
        choices=("fp8",),
        unset="the checkpoint's own",
    )
    quantize_lm_head: bool = setting(
        False,
        "with FP8 weights (quantization fp8, or an FP8 checkpoint): the LM head quantized at load too, e4m3 per "
        "vocabulary row (half the bytes it reads a decode step of up to 16 rows), its 16 largest logits a row "
        "computed again over the unquantized rows it keeps (greedy tokens as without it), which larger steps "
        "multiply; a tied head reads those in the embeddings",
    )
    max_running_reqs: int = setting(256, "requests decoded at once (the decode batch limit)", at_least=1)
    max_seq_len: int | None = setting(
        None,
        "the longest sequence, prompt and output together",
        at_least=1,
        unset="the model's max_position_embeddings",
    )
    load_format: str = setting(
        "auto",
        "auto: the checkpoint's safetensors; dummy: random weights (to measure speed and memory without the weights)",
        choices=("auto", "dummy"),
    )
    gpu_memory_utilization: float = setting(
        0.85, "share of the GPU's memory for weights, KV cache and activations", above=0, at_most=1
    )
    cpu_kv_cache_gb: float = setting(2.0, "KV-cache budget in GiB on a CPU", above=0)
    cpu_threads: int | None = setting(
        None,
        "torch's threads for an engine on a CPU; auto: in launch.py's deployment the host's cores shared "
        "among the replicas' ranks (Ray would give each one), in the offline LLM torch's own choice",
        at_least=1,
        unset="auto",
    )
    cuda_graph_max_bs: int = setting(
        256,
        "largest decode batch replayed from a CUDA graph; 0 turns every CUDA graph off, the extend graphs too",
        at_least=0,
    )
    extend_graph_tokens: int = setting(
        2048,
        "largest eager step (a prompt at low load, a mixed step) in tokens replayed from piecewise CUDA "
        "graphs, the attention run between them; 0: such steps launch op by op",
        at_least=0,
    )
    max_logit_bias: int = setting(
        1024,
        "token ids a request's logit_bias may name (with its stop ids while "
        "min_tokens holds them back); sizes a per-request table on the device",
        at_least=1,
    )
    kernels: Kernels = field(default_factory=Kernels, metadata={"setting": False})
    # the folder of a draft model (speculative decoding) that rank 0's device holds beside this engine,
    # with a KV cache of as many pages: the memory budget's pages are sized so that both fit
    draft_model: str | None = field(default=None, metadata={"setting": False})
    # a speculative draft's own engine (cluster/scheduler/build.py draft_engine_config): its attention window,
    # if it has one, does not bound the served context, since a draft attending past its window only proposes
    # tokens the model then checks
    drafts: bool = field(default=False, metadata={"setting": False})
    # rows a decode step may hold beyond max_running_reqs: a verify step (speculative decoding) runs each
    # speculating request's samples as decode rows of their own, from the decode CUDA graphs; None: none
    max_verify_rows: int | None = field(default=None, metadata={"setting": False})

    @property
    def max_decode_rows(self) -> int:
        """The most rows a decode step holds: requests, or a verify step's samples."""
        return max(self.max_running_reqs, self.max_verify_rows or 0)
