"""Tiny random checkpoints with a small trained tokenizer, built locally with transformers and
tokenizers: for `launch.py --demo` (no network needed) and for the tests. Their output is meaningless."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

TOKENIZER_VOCAB_SIZE = 360

# Std of the normal re-init of every Linear/Embedding weight and bias. Small values (HF's 0.02)
# give flat logits and greedy loops; 0.5 makes Llama/Qwen2 attention near one-hot, which hides
# attention bugs. 0.35 keeps greedy output varied for every fixture variant and seeds 0-2.
INIT_STD = 0.35

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PROMPT_TEXTS: list[str] = [
    "Hello",
    "The capital of France",
    "Café crème, s'il vous plaît.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "日本の首都は東京です。今日は天気がいいですね。",
    "Write a short poem about the moon 🌙 and the stars.",
    "Explain in simple terms why the sky is blue during the day and red at sunset.",
    "Ünïcödé wörds: naïve façade, jalapeño, Straße, smörgåsbord, crème brûlée.",
    "List three prime numbers: 2, 3, 5. Now continue the sequence with the next seven primes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "你好，世界！我们今天学习机器学习和深度学习的基础知识。",
    (
        "In the beginning the engineers built a small serving engine that could batch many "
        "requests together, share the key value cache between them, and stream tokens back "
        "to every client as soon as they were decoded. Later they split the model across "
        "several GPUs, overlapped scheduling with computation, and measured every latency "
        "carefully before calling the work done. 🚀"
    ),
]

_EXTRA_CORPUS: list[str] = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token given all of the previous tokens.",
    "Tokens are decoded one at a time and streamed back to the user.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Élève, garçon, déjà vu, où est la bibliothèque? À bientôt!",
    "Größe, Übung, Mädchen, schön. ¿Dónde está el baño? Ça va très bien.",
    "机器学习是人工智能的一个分支。模型在GPU上运行。",
    "こんにちは、元気ですか？ありがとうございます。",
    "안녕하세요, 만나서 반갑습니다.",
    "Emoji test: 😀 🎉 👍 🌍 ❤️ done.",
    "the the the and and of of to to in in is is it it that that for for with with",
]


def build_tokenizer(out_dir: Path) -> None:
    """Train a tiny byte-level BPE tokenizer and save it as a PreTrainedTokenizerFast."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the English part makes merges favour it, so CJK/emoji stay split into byte tokens.
    corpus = (PROMPT_TEXTS + _EXTRA_CORPUS[:4]) * 3 + _EXTRA_CORPUS
    tok.train_from_iterator(corpus, trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out_dir)


_FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

# transformers 5 folds `rope_theta` and `rope_scaling` into one `rope_parameters` dict.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


def _make_config(
    family: str, vocab_size: int, eos_id: int, tie_word_embeddings: bool, num_kv_heads: int
) -> PretrainedConfig:
    extra: dict[str, object] = {
        # head_dim 32 != hidden_size / num_heads (16), so a loader must honour the explicit value.
        "qwen3": {"head_dim": 32, "rope_parameters": _QWEN_ROPE},
        "llama": {"rope_parameters": _LLAMA3_ROPE},
        "qwen2": {"rope_parameters": _QWEN_ROPE},
    }[family]
    config_cls = _FAMILIES[family][0]
    return config_cls(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        **extra,
    )


def build_checkpoint(
    family: str,
    out_dir: Path,
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Build a tiny random `family` checkpoint (tokenizer included) in `out_dir` and return it."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family: {family!r}")
    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)

    config = _make_config(family, len(tokenizer), eos_id, tie_word_embeddings, num_kv_heads)
    torch.manual_seed(seed)
    model = _FAMILIES[family][1](config).to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, INIT_STD)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, INIT_STD)

    save_kwargs: dict[str, str] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # transformers 5 always writes safetensors (`safe_serialization` is gone).
    model.save_pretrained(out_dir, **save_kwargs)
    GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, im_end_id],
        pad_token_id=eos_id,
        do_sample=False,
    ).save_pretrained(out_dir)
    return out_dir


def build_sharded_checkpoint(
    family: str,
    out_dir: Path,
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_shard_size: str = "20KB",
) -> Path:
    """Build a checkpoint split over several safetensors files plus `model.safetensors.index.json`."""
    out_dir = build_checkpoint(
        family,
        out_dir,
        tie_word_embeddings=tie_word_embeddings,
        num_kv_heads=num_kv_heads,
        seed=seed,
        max_shard_size=max_shard_size,
    )
    if not (out_dir / "model.safetensors.index.json").exists():
        raise RuntimeError(f"max_shard_size={max_shard_size} did not produce a sharded checkpoint")
    return out_dir


# Keyed by resolved path: rebuilding a checkpoint in place needs `_MODEL_CACHE.clear()`.
