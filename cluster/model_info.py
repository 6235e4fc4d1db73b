"""What the control plane needs to know of a model: the folder it is read from, its tokenizer and its
end-of-sequence ids."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def eos_token_ids(model_path: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """Every id that ends a generation: generation_config.json's eos_token_id (a list for Llama-3
    Instruct and Qwen3), the model config's, and the tokenizer's."""
    ids = _as_set(getattr(config, "eos_token_id", None))
    if (Path(model_path) / "generation_config.json").exists():
        ids |= _as_set(GenerationConfig.from_pretrained(model_path).eos_token_id)
    if tokenizer is not None:
        ids |= _as_set(tokenizer.eos_token_id)
    return ids


def local_model(model: str) -> str:
    """The folder the engine reads: `model` itself, or for a GGUF file the Hugging Face folder made from it
    (once, in the cache)."""
    from worker.gguf import gguf_folder, is_gguf

    return str(gguf_folder(model)) if is_gguf(model) else model


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it has none (token-id prompts still work)."""
    path = Path(model_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(model_path)
