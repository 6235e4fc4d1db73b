"""Test fixtures: tiny checkpoints (tests/tiny_checkpoints.py) and Hugging Face greedy references."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tiny_checkpoints import (  # noqa: F401
    PROMPT_TEXTS,
    build_checkpoint,
    build_sharded_checkpoint,
    build_tokenizer,
)
from transformers import AutoModelForCausalLM, PreTrainedModel

_MODEL_CACHE: dict[str, PreTrainedModel] = {}


def _load_model(model_dir: Path) -> PreTrainedModel:
    key = str(Path(model_dir).resolve())
    if key not in _MODEL_CACHE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _MODEL_CACHE[key] = model.eval()
    return _MODEL_CACHE[key]


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[list[int]]:
    """Greedy-decode each prompt separately with HF and return only the new token ids.

    Stops at (and includes) an EOS from generation_config.json unless `ignore_eos` is set,
    in which case exactly `max_new_tokens` tokens are produced.
    """
    model = _load_model(model_dir)
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    gen_config.max_new_tokens = max_new_tokens
    if ignore_eos:
        # None would be refilled from the model's generation_config inside generate(); an empty
        # list disables EOS stopping. min_new_tokens is avoided as it masks EOS logits, which
        # changes the argmax instead of merely not stopping.
        gen_config.eos_token_id = []
    outputs: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen_config,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_generate(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """Greedy `generate` of each prompt with extra generation arguments (repetition_penalty,
    sequence_bias, min_new_tokens, eos_token_id, logits_processor, ...): the new token ids."""
    model = _load_model(model_dir)
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    gen_config.max_new_tokens = max_new_tokens
    processors = kwargs.pop("logits_processor", None)
    for key, value in kwargs.items():
        setattr(gen_config, key, value)
    outputs: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            extra = {} if processors is None else {"logits_processor": processors(len(prompt))}
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config, **extra
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """float32 [len(prompt) - 1, vocab]: the log-probabilities after each prompt position but the last
    (row i scores prompt token i + 1)."""
    model = _load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)
