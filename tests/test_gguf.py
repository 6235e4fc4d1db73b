"""GGUF files: one that is not GGUF, or holds an architecture transformers cannot read or this server does
not run, is one CheckpointError that says which (from LLM and from launch.py alike); the folder made from a
file is named by its contents, so a copy elsewhere names the same one; a file of each architecture served, in
llama.cpp's layout (tests/tiny_gguf.py), whole or in parts, answers as its source checkpoint, and its tensors are
those transformers reads from it. Serving a real GGUF file is tests/test_real_model.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny_gguf
import torch

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


@pytest.mark.parametrize("where", ["metadata", "tensors"])
def test_a_file_cut_short_is_one_error_saying_so_and_no_conversion_is_announced(tmp_path, caplog, where):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    # past the magic and the counts, inside the first key; or a few bytes short of the last tensor's end
    cut.write_bytes(whole[:40] if where == "metadata" else whole[:-8])
    with caplog.at_level("WARNING", logger="worker.gguf"), pytest.raises(CheckpointError) as e:
        gguf_folder(cut, tmp_path / "cache")
    size = len(whole[:40]) if where == "metadata" else len(whole) - 8
    assert f"cut.gguf: it ends before the data its header describes ({size:,} bytes): the file is cut short" in str(
        e.value
    )
    assert "converting" not in caplog.text  # said only of a file that can be read


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


def test_a_folder_an_older_conversion_made_is_made_again_and_named_as_removable(tmp_path, caplog):
    """Conversion 1 (transformers' reading) left out Llama 3's rotary scaling and more: its folders are not read."""
    import worker.gguf

    file = write_gguf(tmp_path / "a.gguf", "llama")
    older = folder_for(file, tmp_path / "cache", conversion=1)
    assert older != folder_for(file, tmp_path / "cache") and worker.gguf.CONVERSION > 1
    older.mkdir(parents=True)
    (older / "model.safetensors").write_bytes(b"")
    with caplog.at_level("WARNING", logger="worker.gguf"), pytest.raises(CheckpointError):  # (no tokenizer)
        gguf_folder(file, tmp_path / "cache")
    assert f"{older}, an older conversion of this file, is no longer read" in caplog.text


def test_a_file_without_a_tokenizer_is_an_error_saying_so(tmp_path):
    # once transformers' ValueError, out of the conversion unnamed
    with pytest.raises(CheckpointError, match=r"llama\.gguf: its tokenizer cannot be read"):
        gguf_folder(write_gguf(tmp_path / "llama.gguf", "llama"), tmp_path / "cache")


def test_a_mixture_under_an_architecture_without_experts_is_an_error_naming_those_read(tmp_path):
    # transformers would read qwen2 with experts as a dense Qwen2 and drop them
    with pytest.raises(CheckpointError, match=r"mixture of 8 experts under GGUF architecture 'qwen2'.*qwen3moe"):
        gguf_folder(write_gguf(tmp_path / "odd.gguf", "qwen2", experts=8), tmp_path / "cache")


# the tiny checkpoint's config values llama.cpp's layout asks for: a Qwen3-MoE without dense layers (the tiny
# llama keeps llama 3's rotary scaling, which its file holds as a tensor of factors)
_AS_LLAMA_CPP_HOLDS = {"qwen3_moe": {"mlp_only_layers": []}}
SERVED = [*tiny_gguf.ARCHITECTURES, "mixtral-per-expert"]


@pytest.fixture(scope="module", params=SERVED)
def gguf_of(request, tmp_path_factory):
    """(the source checkpoint, the GGUF file written from it as llama.cpp lays it out) for each family served."""
    from tiny_checkpoints import build_checkpoint

    family = request.param.removesuffix("-per-expert")
    where = tmp_path_factory.mktemp(request.param)
    src = build_checkpoint(family, where / "src", overrides=_AS_LLAMA_CPP_HOLDS.get(family))
    per_expert = request.param.endswith("-per-expert")
    return src, tiny_gguf.write_gguf_of(src, where / f"{request.param}.gguf", per_expert=per_expert)


def test_a_gguf_of_each_architecture_served_answers_as_its_source_checkpoint(gguf_of, tmp_path):
    """llama.cpp's layout (a llama file's q and k rows reordered for its rotary kernel, a mixture's experts stacked
    a projection or a tensor each, the widths under GGUF keys transformers' GGUF config does not read, which once
    left them at Qwen3-30B-A3B's and Qwen1.5-MoE's, Mixtral as llama with experts): the folder made from it has
    the source's widths and routing, and answers as the source checkpoint does."""
    from fixtures import hf_greedy
    from helpers import checked_llm, greedy
    from tiny_checkpoints import random_prompts
    from transformers import AutoConfig

    from worker.layers.rotary import rope_parameters

    src, file = gguf_of
    folder = gguf_folder(file, tmp_path / "cache")
    made, source = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(src)
    assert made.architectures == source.architectures
    for field in (
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "intermediate_size",
    ):
        assert getattr(made, field, None) == getattr(source, field, None), field
    assert rope_parameters(made) == rope_parameters(source)  # llama's: llama 3's scaling, read from its factors
    prompts = random_prompts(3, 4, 20, seed=2)
    with checked_llm(folder, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert got == hf_greedy(src, prompts, 8, ignore_eos=True)


def test_a_file_transformers_reads_as_mistral_attends_its_whole_context_as_llama_cpp_does(tmp_path):
    """A llama file named "mistral" is read by transformers as a Mistral with its class's default window of 4,096;
    the file holds no window (llama.cpp attends the whole sequence), and neither does the folder made from it."""
    from tiny_checkpoints import build_checkpoint
    from transformers import AutoConfig

    src = build_checkpoint("llama", tmp_path / "src")
    file = tiny_gguf.write_gguf_of(src, tmp_path / "mistral.gguf", name="mistral")
    assert AutoConfig.from_pretrained(tmp_path, gguf_file=file.name).sliding_window == 4096
    made = AutoConfig.from_pretrained(gguf_folder(file, tmp_path / "cache"))
    assert made.model_type == "mistral" and made.sliding_window is None


def test_a_model_in_parts_is_read_across_them_from_any_part(tmp_path, caplog):
    """llama.cpp's gguf-split writes a large model as NAME-00001-of-0000N.gguf, ... (the metadata in the first):
    the folder is made from every part's tensors, named by the first whichever part is given, and answers as the
    source; a part missing is an error naming it."""
    from tiny_checkpoints import build_checkpoint

    from worker.gguf import first_part, model_name

    src = build_checkpoint("qwen3_moe", tmp_path / "src", overrides=_AS_LLAMA_CPP_HOLDS["qwen3_moe"])
    first = tiny_gguf.write_gguf_of(src, tmp_path / "moe.gguf", parts_of=8)
    parts = sorted(tmp_path.glob("moe-*-of-*.gguf"))
    assert len(parts) > 2 and first == parts[0] and first.name == f"moe-00001-of-{len(parts):05d}.gguf"
    assert first_part(parts[1]) == first and first_part(first) == first
    assert model_name(parts[1]) == "moe" == model_name(tmp_path / "moe.gguf")  # the name it serves under
    with caplog.at_level("WARNING", logger="worker.gguf"):
        folder = gguf_folder(parts[1], tmp_path / "cache")
    assert f"converting {first} to a Hugging Face folder in {folder} (once)" in caplog.text
    assert folder == folder_for(first, tmp_path / "cache")
    whole = gguf_folder(tiny_gguf.write_gguf_of(src, tmp_path / "whole.gguf"), tmp_path / "cache")
    assert _answers(folder) == _answers(whole)

    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"its part {parts[-1].name} is not beside it"):
        gguf_folder(first, tmp_path / "again")


Q = gguf.GGMLQuantizationType
# a mix of the file types llama.cpp writes (its quantized files keep norms in F32 and quantize the rest, some
# projections more finely than others), where the tiny widths allow their blocks of 32
_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "attn_norm.weight": Q.BF16,  # vectors too, whose quantized bytes do not split by element
    "ffn_norm.weight": Q.Q8_0,
    "output.weight": Q.Q5_1,
    "attn_q.weight": Q.Q8_0,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.BF16,
    "attn_output.weight": Q.F16,
    "ffn_gate.weight": Q.Q4_0,
    "ffn_up.weight": Q.Q5_0,
    "ffn_down.weight": Q.Q8_0,
    "ffn_gate_exps.weight": Q.Q8_0,
    "ffn_up_exps.weight": Q.F16,  # gate and up of other types: their joined tensor float32
    "ffn_down_exps.weight": Q.Q4_1,
    "ffn_gate_shexp.weight": Q.Q8_0,
}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
def test_a_quantized_files_tensors_are_those_transformers_reads_from_it(tmp_path, family):
    """Each tensor of the folder, dequantized a tensor at a time, equals what transformers' own GGUF reading gives
    (all of the file at once), llama's q and k rows put back in their order."""
    from safetensors.torch import load_file
    from tiny_checkpoints import build_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = build_checkpoint(family, tmp_path / "src", overrides=_AS_LLAMA_CPP_HOLDS.get(family))
    file = tmp_path / f"{family}.gguf"
    tiny_gguf.write_gguf_of(src, file, types=_TYPES)
    folder = gguf_folder(file, tmp_path / "cache")
    ours = load_file(str(folder / "model.safetensors"))

    config = AutoConfig.from_pretrained(tmp_path, gguf_file=file.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)["tensors"]
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name].float()), name
    # a file's own float formats kept as they are, a quantized tensor's values float32
    layer = "model.layers.0"
    if family == "llama":
        assert ours[f"{layer}.self_attn.v_proj.weight"].dtype == torch.bfloat16
        assert ours[f"{layer}.self_attn.o_proj.weight"].dtype == torch.float16
        assert ours[f"{layer}.self_attn.q_proj.weight"].dtype == torch.float32
    else:
        assert ours[f"{layer}.mlp.experts.gate_up_proj"].dtype == torch.float32


def test_a_model_larger_than_a_shard_is_written_in_shards_and_answers_the_same(tmp_path, monkeypatch):
    """The conversion holds a shard of the weights at a time: past SHARD_BYTES it writes another file, and the
    folder (an index naming each tensor's file) answers as one file does."""
    import json

    from tiny_checkpoints import build_checkpoint

    import worker.gguf

    src = build_checkpoint("qwen3_moe", tmp_path / "src", overrides=_AS_LLAMA_CPP_HOLDS["qwen3_moe"])
    file = tiny_gguf.write_gguf_of(src, tmp_path / "moe.gguf")
    whole = gguf_folder(file, tmp_path / "whole")
    monkeypatch.setattr(worker.gguf, "SHARD_BYTES", 64 << 10)
    sharded = gguf_folder(file, tmp_path / "sharded")
    index = json.loads((sharded / worker.gguf.INDEX).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and not (sharded / "model.safetensors").exists()
    assert all((sharded / f).stat().st_size < 2 * (64 << 10) + (1 << 20) for f in files)  # a tensor past the mark
    assert _answers(sharded) == _answers(whole)


def _answers(folder: Path) -> list[list[int]]:
    """A few random prompts' greedy tokens from the model in `folder`."""
    from helpers import checked_llm, greedy
    from tiny_checkpoints import random_prompts

    with checked_llm(folder, page_size=4) as llm:
        return [o.token_ids for o in llm.generate(random_prompts(2, 4, 16, seed=3), greedy(6, ignore_eos=True))]


def _with_tensors(path: Path, tensors: dict) -> Path:
    """A qwen2 GGUF (its keys and a tokenizer) holding `tensors` alone."""
    import tiny_checkpoints

    src = tiny_checkpoints.build_checkpoint("qwen2", path.parent / "src")
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    tiny_gguf._add_tokenizer(writer, src)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tensor_no_model_served_has_is_named_not_dropped(tmp_path):
    file = _with_tensors(tmp_path / "odd.gguf", {"blk.0.attn_qkv.weight": np.zeros((48, 16), np.float32)})
    with pytest.raises(CheckpointError, match=r"odd\.gguf: it holds a tensor 'blk\.0\.attn_qkv\.weight'"):
        gguf_folder(file, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir()), "nothing half-made is left in the cache"


def test_experts_with_a_gate_and_no_up_projection_are_an_error(tmp_path):
    file = _with_tensors(tmp_path / "half.gguf", {"blk.0.ffn_gate_exps.weight": np.zeros((2, 32, 16), np.float32)})
    with pytest.raises(CheckpointError, match=r"half\.gguf: its experts' gate or up projection is missing"):
        gguf_folder(file, tmp_path / "cache")


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 32.0, "rope_theta": 500000.0, "head_dim": 64},  # Llama 3.2 1B and 3B
        {"factor": 8.0, "rope_theta": 500000.0, "head_dim": 128},  # Llama 3.1 8B and 70B
    ],
)
def test_llama_3s_rotary_scaling_is_read_back_from_its_factors(rope):
    from worker.gguf_rope import llama3_rope

    published = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    published.update(factor=rope["factor"], original_max_position_embeddings=8192)
    factors = tiny_gguf.rope_factors({**published, "rope_theta": rope["rope_theta"]}, rope["head_dim"])
    assert llama3_rope(factors, rope["rope_theta"], rope["head_dim"]) == published
    assert llama3_rope(np.ones_like(factors), rope["rope_theta"], rope["head_dim"]) is None


def test_rotary_factors_no_llama_3_scaling_gives_are_an_error_not_a_guess(tmp_path):
    from worker.gguf_rope import llama3_rope

    factors = np.linspace(1.0, 8.0, 32)  # smooth over every pair: no band left unscaled
    with pytest.raises(CheckpointError, match="rope_freqs are not llama 3's rotary scaling"):
        llama3_rope(factors, 500000.0, 64)
