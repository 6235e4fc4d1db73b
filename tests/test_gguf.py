"""GGUF files: one that is not GGUF, or holds an architecture transformers cannot read or this server does
not run, is one CheckpointError that says which (from LLM and from launch.py alike); the folder made from a
file is named by its contents, so a copy elsewhere names the same one; a mixture of experts in llama.cpp's
layout (tests/tiny_gguf.py) answers as its source checkpoint. Serving a real GGUF file is
tests/test_real_model.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cluster import LLM
from worker.gguf import folder_for, gguf_folder, is_gguf
from worker.loader import CheckpointError

ROOT = Path(__file__).resolve().parent.parent


def write_gguf(path: Path, arch: str, experts: int = 0) -> Path:
    """A GGUF file of one small tensor under `arch`'s name, with the few keys a config is read from (and an
    expert count, as llama.cpp writes a mixture's)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((10, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_this_server_does_not_run_is_named(tmp_path):
    with pytest.raises(
        CheckpointError, match="holds a GPT2LMHeadModel, which this server does not run; it runs Llama"
    ) as e:
        gguf_folder(write_gguf(tmp_path / "gpt2.gguf", "gpt2"), tmp_path / "cache")
    assert "Eagle" not in str(e.value)  # a draft head is served only beside its model: not listed
    assert not list((tmp_path / "cache").iterdir()), "nothing half-made is left in the cache"


def test_an_architecture_transformers_cannot_read_is_one_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF checkpoint: .*architecture foo"):
        gguf_folder(write_gguf(tmp_path / "foo.gguf", "foo"), tmp_path / "cache")


def test_a_file_that_is_not_gguf_is_one_error_from_the_offline_llm(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a checkpoint " * 8)
    assert is_gguf(bad) and not is_gguf(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF checkpoint: .*magic"):
        LLM(str(bad))


def test_a_file_cut_inside_its_metadata_is_one_error(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:40])  # past the magic and the counts, inside the first key
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF checkpoint"):
        gguf_folder(cut, tmp_path / "cache")


def test_the_module_that_makes_a_folder_ahead_says_what_is_wrong_in_one_line(tmp_path):
    for args in ([], [str(tmp_path / "missing.gguf")]):
        done = subprocess.run([sys.executable, "-m", "worker.gguf", *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_launch_names_a_bad_gguf_file_in_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a checkpoint " * 8)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--model", str(bad)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "cannot be read as a GGUF checkpoint" in lines[0], done.stderr


def test_a_copy_of_a_file_names_the_same_folder_and_another_file_another(tmp_path):
    first = write_gguf(tmp_path / "a.gguf", "llama")
    (tmp_path / "elsewhere").mkdir()
    copy = Path(shutil.copy(first, tmp_path / "elsewhere" / "a.gguf"))
    other = write_gguf(tmp_path / "elsewhere" / "b.gguf", "qwen2")
    assert folder_for(first, tmp_path) == folder_for(copy, tmp_path)
    assert folder_for(other, tmp_path) != folder_for(first, tmp_path)


def test_a_file_without_a_tokenizer_is_an_error_saying_so(tmp_path):
    # once transformers' ValueError, out of the conversion unnamed
    with pytest.raises(CheckpointError, match=r"llama\.gguf: its tokenizer cannot be read"):
        gguf_folder(write_gguf(tmp_path / "llama.gguf", "llama"), tmp_path / "cache")


def test_a_mixtral_gguf_is_an_error_naming_the_mixtures_that_are_read(tmp_path):
    # llama.cpp writes Mixtral as llama with experts, which transformers would read as a dense Llama
    with pytest.raises(CheckpointError, match=r"mixture of 8 experts under GGUF architecture 'llama'.*qwen3moe"):
        gguf_folder(write_gguf(tmp_path / "mixtral.gguf", "llama", experts=8), tmp_path / "cache")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_mixture_of_experts_gguf_serves_as_its_source_checkpoint(tmp_path, family):
    """llama.cpp's layout of a mixture (each layer's experts stacked a projection, the widths under GGUF keys
    transformers' GGUF config does not read, which once left them at Qwen3-30B-A3B's and Qwen1.5-MoE's): the
    folder made from it has the source's widths and routing, and answers as the source checkpoint does."""
    from fixtures import hf_greedy
    from helpers import checked_llm, greedy
    from tiny_checkpoints import build_checkpoint, random_prompts
    from tiny_gguf import write_moe_gguf
    from transformers import AutoConfig

    # llama.cpp's qwen3moe has no dense layers
    src = build_checkpoint(
        family, tmp_path / "src", overrides={"mlp_only_layers": []} if family == "qwen3_moe" else None
    )
    folder = gguf_folder(write_moe_gguf(src, tmp_path / f"{family}.gguf"), tmp_path / "cache")
    made, source = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(src)
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "num_experts"):
        assert getattr(made, field, None) == getattr(source, field, None), field
    prompts = random_prompts(3, 4, 20, seed=2)
    with checked_llm(folder, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert got == hf_greedy(src, prompts, 8, ignore_eos=True)
