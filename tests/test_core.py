"""The engine core against Hugging Face transformers: greedy parity per model family, text,
sampling, stopping, loading errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy

from cluster import LLM, InvalidRequestError, SamplingParams
from worker.loader import CheckpointError
from worker.models import UnsupportedModelError


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_greedy_output_equals_hf_generate_for_each_family(model_paths, family):
    path = model_paths[family]
    with checked_llm(path, overlap=False) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        outs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 16)


def test_tied_embeddings_and_sharded_checkpoint_match_hf(qwen3_tied_path, qwen3_sharded_path):
    for path in (qwen3_tied_path, qwen3_sharded_path):
        with checked_llm(path) as llm:
            prompts = encode_all(llm, PROMPT_TEXTS[:3])
            outs = llm.generate(prompts, greedy(8))
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 8)


def test_text_is_the_tokenizers_decode_of_the_tokens(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        outs = llm.generate(PROMPT_TEXTS[:4], greedy(10))
        for out in outs:
            assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            assert out.prompt_token_ids == llm.tokenizer(PROMPT_TEXTS[outs.index(out)]).input_ids


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(qwen3_path):
    params = lambda seed: SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=seed, ignore_eos=True
    )
    with checked_llm(qwen3_path) as llm:
        prompt = llm.tokenizer(PROMPT_TEXTS[2]).input_ids
        alone = llm.generate([prompt], params(7))[0].token_ids
        # the same request among others, at another batch position, must sample the same tokens
        crowd = llm.generate(
            [llm.tokenizer(t).input_ids for t in PROMPT_TEXTS[:5]] + [prompt],
            [params(i) for i in range(5)] + [params(7)],
        )
        other = llm.generate([prompt], params(8))[0].token_ids
    assert crowd[-1].token_ids == alone
    assert other != alone


def test_every_eos_id_in_generation_config_list_stops_generation(qwen3_path, tmp_path):
    with checked_llm(qwen3_path) as llm:
        prompt = llm.tokenizer(PROMPT_TEXTS[0]).input_ids
        free = llm.generate([prompt], greedy(20, ignore_eos=True))[0].token_ids
    # a copy whose generation_config lists a token the model emits as its last end-of-sequence id
    shutil.copytree(qwen3_path, tmp_path / "m")
    gen_path = tmp_path / "m" / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    assert isinstance(gen["eos_token_id"], list) and len(gen["eos_token_id"]) > 1
    gen["eos_token_id"] = gen["eos_token_id"] + [free[3]]
    gen_path.write_text(json.dumps(gen))
    with checked_llm(tmp_path / "m") as llm:
        stopped = llm.generate([prompt], greedy(20))[0]
        ignored = llm.generate([prompt], greedy(20, ignore_eos=True))[0]
    assert stopped.token_ids == free[: free.index(free[3]) + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == free


def test_max_tokens_is_exact_and_finish_reason_is_length(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        outs = llm.generate(PROMPT_TEXTS[:3], [greedy(n, ignore_eos=True) for n in (1, 5, 17)])
    assert [len(o.token_ids) for o in outs] == [1, 5, 17]
    assert {o.finish_reason for o in outs} == {"length"}


def test_stop_token_ids_end_the_request(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        free = llm.generate(PROMPT_TEXTS[1], greedy(12, ignore_eos=True))[0].token_ids
        stopped = llm.generate(PROMPT_TEXTS[1], greedy(12, ignore_eos=True, stop_token_ids=[free[5]]))[0]
    assert stopped.token_ids == free[: free.index(free[5]) + 1]
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=True)


def test_prompt_longer_than_the_context_is_rejected(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        too_long = [5] * llm.engine.max_seq_len
        with pytest.raises(InvalidRequestError, match="context"):
            llm.generate([too_long], greedy(4))
        with pytest.raises(InvalidRequestError, match="empty"):
            llm.generate([[]], greedy(4))


def test_invalid_sampling_params_are_rejected():
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_unsupported_architecture_is_named(qwen3_path, tmp_path):
    shutil.copytree(qwen3_path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MadeUpForCausalLM") as e:
        LLM(str(tmp_path / "m"))
    # what a user may serve, not the draft heads that only run beside a model
    assert "Qwen3ForCausalLM" in str(e.value) and "Eagle3" not in str(e.value)


def test_architectures_written_as_one_string_is_named_not_read_letter_by_letter(qwen3_path, tmp_path):
    shutil.copytree(qwen3_path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = "Qwen3ForCausalLM"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=re.escape('"architectures" is a list of names: write ["Qwen3')):
        LLM(str(tmp_path / "m"))


@pytest.mark.parametrize(
    "tensor,shape",
    [
        ("model.layers.1.self_attn.k_proj.weight", (48, 64)),  # a column-parallel part (k of the fused qkv)
        ("model.layers.0.mlp.down_proj.weight", (64, 96)),  # a row-parallel weight
        ("model.layers.0.input_layernorm.weight", (32,)),  # loaded as it is
        ("model.embed_tokens.weight", (300, 64)),  # a vocabulary other than the config's
    ],
)
def test_a_tensor_of_another_shape_than_the_config_makes_it_is_named(qwen3_path, tmp_path, tensor, shape):
    # each once loaded a wrong slice without a word, or failed inside a copy in torch's words
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    want = list(weights[tensor].shape)
    weights[tensor] = torch.zeros(shape)
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{tensor}'") + r".*" + re.escape(f"{list(shape)}, but")) as e:
        LLM(str(tmp_path / "m"))
    assert str(want) in str(e.value)


def test_missing_or_corrupt_checkpoint_files_are_named(qwen3_path, qwen3_sharded_path, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path))
    shutil.copytree(qwen3_sharded_path, tmp_path / "missing")
    victim = sorted((tmp_path / "missing").glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        LLM(str(tmp_path / "missing"))
    shutil.copytree(qwen3_path, tmp_path / "corrupt")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(tmp_path / "corrupt"))


def test_missing_tensor_is_named(qwen3_path, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.gate_up_proj"):
        LLM(str(tmp_path / "m"))


def test_dummy_weights_need_no_checkpoint_file(qwen3_path, tmp_path):
    shutil.copy(qwen3_path / "config.json", tmp_path / "config.json")
    with checked_llm(tmp_path, load_format="dummy") as llm:
        out = llm.generate([[1, 2, 3]], greedy(4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_explicit_dtype_is_used(qwen3_path):
    with checked_llm(qwen3_path, dtype="bfloat16") as llm:
        assert llm.engine.kv.dtype == torch.bfloat16
        assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
        out = llm.generate(PROMPT_TEXTS[0], greedy(4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
