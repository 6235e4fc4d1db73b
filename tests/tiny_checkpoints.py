"""The tests' tiny random checkpoints: every supported family (the mixtures of experts too), tied
embeddings, one KV head, sharded files; with a tokenizer trained on the tests' prompts. Built with the
demo model's writer (demo.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from demo import EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, INIT_STD, VOCAB_SIZE, save_random_model, save_tokenizer
from demo import build_tokenizer as _build_tokenizer

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


def build_tokenizer(out_dir: Path):
    """The tiny tokenizer, trained on the tests' prompts (repeating the English part makes merges
    favour it, so CJK and emoji stay split into byte tokens)."""
    return _build_tokenizer(out_dir, (PROMPT_TEXTS + _EXTRA_CORPUS[:4]) * 3 + _EXTRA_CORPUS)


def build_metaspace_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2's and Mistral's kind) on the tests' prompts: words' first
    pieces carry the space before them ("▁Paris"), whose decoder strips it at the start of a text, and
    characters outside its 100 pieces fall back to their bytes (<0xE2>); as many ids as the byte-level one."""
    specials = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 256, special_tokens=specials, limit_alphabet=40, show_progress=False
    )
    trained.train_from_iterator((PROMPT_TEXTS + _EXTRA_CORPUS[:4]) * 3, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return save_tokenizer(tok, out_dir)


def with_metaspace_tokenizer(src: Path, out_dir: Path) -> Path:
    """`src`'s checkpoint in `out_dir` with build_metaspace_tokenizer's tokenizer in place of its own."""
    shutil.copytree(src, out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out_dir / name).unlink(missing_ok=True)
    build_metaspace_tokenizer(out_dir)
    return out_dir


_FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")

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
    family: str,
    vocab_size: int,
    eos_id: int,
    tie_word_embeddings: bool,
    num_kv_heads: int,
    overrides: dict[str, object] | None = None,
) -> PretrainedConfig:
    extra: dict[str, object] = {
        # head_dim 32 != hidden_size / num_heads (16), so a loader must honour the explicit value.
        "qwen3": {"head_dim": 32, "rope_parameters": _QWEN_ROPE},
        "llama": {"rope_parameters": _LLAMA3_ROPE},
        "qwen2": {"rope_parameters": _QWEN_ROPE},
        # a dense layer among sparse ones (mlp_only_layers); top-k weights renormalised (norm_topk_prob)
        "qwen3_moe": {
            "head_dim": 32,
            "rope_parameters": _QWEN_ROPE,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        # top-4 of 8 weights as the softmax left them, and the gated shared expert
        "qwen2_moe": {
            "rope_parameters": _QWEN_ROPE,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": False,
        },
        "mixtral": {"rope_parameters": _QWEN_ROPE, "num_local_experts": 4, "num_experts_per_tok": 2},
    }[family]
    config_cls = _FAMILIES[family][0]
    extra = {"num_hidden_layers": 2, **extra, **(overrides or {})}
    return config_cls(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
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
    overrides: dict[str, object] | None = None,
) -> Path:
    """Build a tiny random `family` checkpoint (tokenizer included) in `out_dir` and return it; `overrides`:
    config values in place of the family's."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family: {family!r}")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = _make_config(family, len(tokenizer), eos_id, tie_word_embeddings, num_kv_heads, overrides)
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    torch.manual_seed(seed)
    model = _FAMILIES[family][1](config)
    _draw_stacked_experts(model)
    return save_random_model(model, tokenizer, out_dir, **options)


def _draw_stacked_experts(model: PreTrainedModel) -> None:
    """The routers and the experts (parameters of their own modules, not nn.Linear, which
    save_random_model draws) at the same scale as the other weights, so that routing matters."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                continue
            for param in module.parameters(recurse=False):
                if param.dim() >= 2:
                    param.normal_(0.0, INIT_STD)


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


def _save_hd128(model: PreTrainedModel, out: Path) -> Path:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, INIT_STD)
    model.save_pretrained(out)
    return out


def _hd128_eos(out: Path) -> int:
    from transformers import PreTrainedTokenizerFast

    _build_tokenizer(out)
    return PreTrainedTokenizerFast.from_pretrained(out).convert_tokens_to_ids(EOS_TOKEN)


def build_qwen3_hd128(out: Path) -> Path:
    """A tiny Qwen3 with the benchmark's head size (128) and GQA group (2): FlashInfer builds kernels for
    it (none for the CPU models' head sizes)."""
    eos = _hd128_eos(out)
    config = Qwen3Config(
        vocab_size=360,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    return _save_hd128(Qwen3ForCausalLM(config), out)


def build_llama_hd128(out: Path) -> Path:
    """A tiny Llama 3 (its rope scaling) with a head size FlashInfer builds kernels for."""
    eos = _hd128_eos(out)
    config = LlamaConfig(
        vocab_size=360,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(0)
    return _save_hd128(LlamaForCausalLM(config), out)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random ids of the head-size-128 models' vocabulary (3..359)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 360) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def build_eagle3_head(
    target_dir: Path,
    out_dir: Path,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: tuple[int, int, int] = (0, 1, 1),
    successor_of: list[int] | None = None,
    own_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """A tiny EAGLE-3 draft head for the model in `target_dir`, written as published
    (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head` over a `draft_vocab_size` subset of
    the model's vocabulary mapped by `d2t`, `t2d`), random. With `successor_of` (a token's successor),
    the head proposes successors instead: its attention copies the current token's embedding (q and k
    alike, so each position attends to itself), the model's hidden states and its MLP are all but muted,
    and its LM head scores a token by how well its predecessor's embedding matches."""
    import json

    from safetensors.torch import load_file, save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, head_dim, inter = 4, hidden // 4, 2 * hidden
    dv = draft_vocab_size or vocab
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=1,
        max_position_embeddings=target["max_position_embeddings"],
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = dv
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    ids = sorted(torch.randperm(vocab, generator=gen)[:dv].tolist())
    w = {
        "fc.weight": draw(hidden, 3 * hidden, std=0.1),
        "norm.weight": 1 + draw(hidden, std=0.05),
        "lm_head.weight": draw(dv, hidden),
        "d2t": torch.tensor([t - i for i, t in enumerate(ids)], dtype=torch.int64),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True),
    }
    layer = {
        "self_attn.q_proj.weight": draw(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": draw(heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": draw(heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": draw(hidden, heads * head_dim),
        "mlp.gate_proj.weight": draw(inter, hidden),
        "mlp.up_proj.weight": draw(inter, hidden),
        "mlp.down_proj.weight": draw(hidden, inter),
        "input_layernorm.weight": 1 + draw(hidden, std=0.05),
        "hidden_norm.weight": 1 + draw(hidden, std=0.05),
        "post_attention_layernorm.weight": 1 + draw(hidden, std=0.05),
    }
    embed = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"].float()
    if successor_of is not None:
        eye, zeros = torch.eye(hidden), torch.zeros(hidden, hidden)
        layer["self_attn.q_proj.weight"] = 6 * torch.cat([eye, zeros], dim=1)
        layer["self_attn.k_proj.weight"] = 6 * torch.cat([eye, zeros], dim=1)
        layer["self_attn.v_proj.weight"] = torch.cat([eye, zeros], dim=1)
        layer["self_attn.o_proj.weight"] = 10 * eye
        layer["mlp.down_proj.weight"] = torch.zeros(hidden, inter)
        for name in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"):
            layer[name] = torch.ones(hidden)
        w["norm.weight"] = torch.ones(hidden)
        w["fc.weight"] = w["fc.weight"] * 0.01
        normed = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        predecessor = {b: a for a, b in enumerate(successor_of)}
        w["lm_head.weight"] = torch.stack([normed[predecessor[t]] for t in ids])
    w.update({f"midlayer.{name}": t for name, t in layer.items()})
    if own_embeddings:
        w["embed_tokens.weight"] = embed
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def build_cycling_checkpoint(src: Path, dst: Path, seed: int = 0, lean: float = 3.0) -> tuple[Path, list[int]]:
    """A copy of the tiny model in `src` whose output mostly follows short cycles of tokens (its layers'
    outputs shrunk, its LM head leaning to a permutation of the current token's embedding, by `lean`):
    the copy's folder, and each token's successor in its cycle."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    w = load_file(str(Path(src) / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.02
    emb = w["model.embed_tokens.weight"]
    rng = np.random.default_rng(seed)
    order, nxt, i = rng.permutation(len(emb)).tolist(), list(range(len(emb))), 0
    while i < len(order):  # cycles of 1-6 tokens
        cycle = order[i : i + int(rng.integers(1, 7))]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            nxt[a] = b
        i += len(cycle)
    prev = torch.empty(len(emb), dtype=torch.long)
    prev[torch.tensor(nxt)] = torch.arange(len(emb))
    w["lm_head.weight"] = (w["lm_head.weight"] + lean * (emb / emb.norm(dim=1, keepdim=True))[prev]).contiguous()
    save_file(w, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return Path(dst), nxt
