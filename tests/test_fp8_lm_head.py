"""quantize_lm_head: with FP8 weights the LM head is e4m3 too, a float32 scale a vocabulary row. The model
is then exactly transformers' over the dequantized head (and linears); its logits stay within FP8's rounding
of the unquantized head's; a head tied to the embeddings gets its own e4m3 copy and the embeddings keep
their dtype; every rank scales its rows as one rank would; without FP8 weights the setting is an error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from fp8_checkpoints import quantize_channels
from helpers import assert_tp2_equals_tp1, checked_llm, encode_all, greedy
from safetensors.torch import load_file, save_file

from cluster import LLM
from worker.kernels import Kernels
from worker.quant import gemm
from worker.quant.fp8 import FP8
from worker.quant.scheme import QuantizationError

# the relative error of the logits of a head rounded to e4m3 a row (3 mantissa bits: a weight within 1/16
# of itself, the errors of a row's products mostly cancelling): 0.025 measured on the tiny Qwen3, 0.041
# on SmolLM2
HEAD_LOGIT_TOL = 0.06


def _dequantized_reference(src, out, tied: bool):
    """`src` with every projection and the LM head rounded per output row to e4m3 (the test's own
    quantizer, float32 scales) and dequantized; a tied head is written out as a head of its own, so that
    the embeddings stay as they were."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        config = json.loads((out / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config))
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            q, s = quantize_channels(w, torch.float32)
            tensors[name] = q.float() * s
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_is_transformers_over_its_dequantized_e4m3_head(qwen3_path, qwen3_tied_path, tmp_path, tied):
    path = qwen3_tied_path if tied else qwen3_path
    ref = _dequantized_reference(path, tmp_path / "ref", tied)
    with checked_llm(path, page_size=4, quantization="fp8", quantize_lm_head=True) as llm:
        model = llm.engine.model
        assert model.lm_head.weight.dtype == FP8
        assert model.lm_head.weight_scale.dtype == torch.float32
        embeddings = model.model.embed_tokens.weight
        assert embeddings.dtype == torch.float32  # a tied head's copy is its own
        assert torch.equal(embeddings, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        got = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 16, ignore_eos=True)


def test_the_e4m3_heads_logits_stay_within_fp8_rounding_of_the_unquantized_heads(qwen3_path):
    prompts = [[5 + i, 40 + 3 * i, 7, 90 - i] for i in range(6)]

    def last_logits(**kw) -> torch.Tensor:
        rows = []
        with checked_llm(qwen3_path, page_size=4, quantization="fp8", **kw) as llm:
            compute_logits = llm.engine.model.compute_logits
            llm.engine.model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
            for p in prompts:
                llm.generate([p], greedy(1))
        return torch.stack([r[-1] for r in rows])

    want, got = last_logits(), last_logits(quantize_lm_head=True)
    error = float((got - want).norm() / want.norm())
    assert 0 < error < HEAD_LOGIT_TOL


def test_ranks_scale_their_vocabulary_rows_as_one_rank_does(ray_cluster, qwen3_path):
    prompts = [[3 + i, 50 + i, 11, 70 + 2 * i] for i in range(4)]
    assert_tp2_equals_tp1(qwen3_path, prompts, 12, quantization="fp8", quantize_lm_head=True)


def test_batch_1_decode_reads_the_e4m3_head_through_the_fp8_gemv(qwen3_path, tmp_path, monkeypatch):
    """Under Triton's interpreter one prompt's head is the FP8 GEMV over the e4m3 rows (at a batch of
    several, cuBLASLt's scaled GEMM on a GPU, the dequantized product here)."""
    pytest.importorskip("triton")
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")
    ref = _dequantized_reference(qwen3_path, tmp_path / "ref", tied=False)
    vocab = []
    real_gemv = gemm.fp8_gemv
    monkeypatch.setattr(gemm, "fp8_gemv", lambda x, w, *a, **k: vocab.append(w.shape[0]) or real_gemv(x, w, *a, **k))
    prompt = [[5, 40, 7, 90, 13]]
    with checked_llm(
        qwen3_path, page_size=4, quantization="fp8", quantize_lm_head=True, kernels=Kernels(interpret_on_cpu=True)
    ) as llm:
        head_rows = llm.engine.model.lm_head.weight.shape[0]
        got = llm.generate(prompt, greedy(3, ignore_eos=True))[0].token_ids
    assert [got] == hf_greedy(ref, prompt, 3, ignore_eos=True)
    assert head_rows in vocab


def test_quantize_lm_head_without_fp8_weights_is_an_error_naming_it(qwen3_path):
    with pytest.raises(QuantizationError, match="quantize_lm_head"):
        LLM(str(qwen3_path), page_size=4, num_pages=64, quantize_lm_head=True)


def test_the_real_models_e4m3_head_moves_its_logits_within_fp8_rounding(smollm2_path):
    """SmolLM2 (its head tied to its embeddings) quantized at load, with the head in e4m3 and without: the
    chat prompts' next-token logits differ by FP8's rounding of the head (0.041 of their norm measured).
    That is enough to turn a near tie: its first answer token for France's capital changes (README)."""
    from test_real_model import QUESTIONS, chat_ids

    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_path))
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]

    def last_logits(**kw) -> torch.Tensor:
        rows = []
        with checked_llm(smollm2_path, page_size=16, num_pages=256, quantization="fp8", **kw) as llm:
            model = llm.engine.model
            if kw:
                assert model.lm_head.weight.dtype == FP8 and model.model.embed_tokens.weight.dtype != FP8
            compute_logits = model.compute_logits
            model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
            for p in prompts:
                llm.generate([p], greedy(1))
        return torch.stack([r[-1] for r in rows])

    want, got = last_logits(), last_logits(quantize_lm_head=True)
    assert 0 < float((got - want).norm() / want.norm()) < HEAD_LOGIT_TOL


@pytest.mark.parametrize("served", ["quantized at load", "an FP8 checkpoint"])
def test_a_draft_beside_a_served_model_with_an_e4m3_head_keeps_its_own_head(qwen3_path, tmp_path, served):
    """The setting names the served model's head: a draft model (an unquantized checkpoint, which has no FP8
    weights of its own beside an FP8 checkpoint) starts and drafts with its head as it is."""
    if served == "an FP8 checkpoint":
        from fp8_checkpoints import write_fp8_checkpoint
        from tiny_checkpoints import build_qwen3_hd128

        path, draft = write_fp8_checkpoint(build_qwen3_hd128(tmp_path / "src"), tmp_path, "fp8")
        kw = {}
    else:
        path, draft, kw = qwen3_path, qwen3_path, {"quantization": "fp8"}
    spec = dict(speculative_method="draft", speculative_model=str(draft), num_speculative_tokens=3)
    with checked_llm(path, page_size=4, quantize_lm_head=True, **kw, **spec) as llm:
        assert llm.engine.model.lm_head.weight.dtype == FP8
        assert llm.scheduler.spec.draft.engine.model.lm_head.weight.dtype != FP8
        outs = llm.generate([[5, 40, 7, 90]], greedy(8, ignore_eos=True))
    assert len(outs[0].token_ids) == 8
