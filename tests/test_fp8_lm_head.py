"""quantize_lm_head: with FP8 weights the LM head is e4m3 too, a float32 scale a vocabulary row, and its 16
largest logits a row are computed again over the unquantized rows. So greedy decoding is transformers' over
the (dequantized) FP8 linears and the unquantized head, token for token; those 16 logits are the unquantized
head's and the rest stay within FP8's rounding; a head tied to the embeddings gets its own e4m3 copy and the
embeddings keep their dtype; every rank scales and refines its rows as one rank would; a draft model keeps
its own head; without FP8 weights the setting is an error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from fp8_checkpoints import write_rounded_projections
from helpers import checked_llm, encode_all, greedy
from safetensors.torch import load_file

from cluster import LLM
from cluster.scheduler.draft import weight_bytes
from worker.kernels import Kernels
from worker.layers.embedding import E4M3_HEAD_MAX_ROWS, REFINED_CANDIDATES, ParallelLMHead
from worker.parallel import TPGroup
from worker.quant import gemm
from worker.quant.fp8 import FP8
from worker.quant.prepare import quantize_lm_head
from worker.quant.scheme import QuantizationError

# the relative error of the logits of a head rounded to e4m3 a row (3 mantissa bits: a weight within 1/16
# of itself, the errors of a row's products mostly cancelling): 0.025 measured on the tiny Qwen3, 0.041
# on SmolLM2
HEAD_LOGIT_TOL = 0.06


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_are_transformers_over_the_unquantized_head(qwen3_path, qwen3_tied_path, tmp_path, tied):
    path = qwen3_tied_path if tied else qwen3_path
    ref = write_rounded_projections(path, tmp_path / "ref")
    with checked_llm(path, page_size=4, quantization="fp8", quantize_lm_head=True) as llm:
        model = llm.engine.model
        assert model.lm_head.weight.dtype == FP8
        assert model.lm_head.weight_scale.dtype == torch.float32
        embeddings = model.model.embed_tokens.weight
        assert embeddings.dtype == torch.float32  # a tied head's copy is its own
        assert torch.equal(embeddings, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])
        assert (model.lm_head.exact_weight.data_ptr() == embeddings.data_ptr()) == tied
        counted = weight_bytes(model)
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        got = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 16, ignore_eos=True)
    # the bytes a draft is weighed by: the head's e4m3 weight (a tied head's copy added, an untied head's
    # float32 weight replaced), not the unquantized rows kept beside it
    with checked_llm(path, page_size=4, quantization="fp8") as llm:
        head = llm.engine.model.lm_head.weight
        assert counted == weight_bytes(llm.engine.model) + (head.numel() if tied else -3 * head.numel())


def _last_logits(path, prompts, **kw) -> torch.Tensor:
    rows = []
    with checked_llm(path, page_size=4, num_pages=256, quantization="fp8", **kw) as llm:
        model = llm.engine.model
        if kw.get("quantize_lm_head"):
            assert model.lm_head.weight.dtype == FP8 and model.model.embed_tokens.weight.dtype != FP8
        compute_logits = model.compute_logits
        model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
        for p in prompts:
            llm.generate([p], greedy(1))
    return torch.stack([r[-1] for r in rows])


def _assert_refined(got: torch.Tensor, want: torch.Tensor, top: int = 4) -> None:
    """Each row's `top` largest logits are the unquantized head's: the same tokens in the same order, the
    same values to float32's rounding (they are among the e4m3 head's REFINED_CANDIDATES largest, which are
    computed again); every logit within FP8's rounding of the unquantized head's."""
    assert top < REFINED_CANDIDATES
    g, w = got.topk(top, dim=-1), want.topk(top, dim=-1)
    assert torch.equal(g.indices, w.indices)
    assert torch.allclose(g.values, w.values, rtol=1e-5, atol=1e-5)
    assert 0 < float((got - want).norm() / want.norm()) < HEAD_LOGIT_TOL


def test_the_largest_logits_are_the_unquantized_heads_and_the_rest_within_fp8_rounding(qwen3_path):
    prompts = [[5 + i, 40 + 3 * i, 7, 90 - i] for i in range(6)]
    _assert_refined(_last_logits(qwen3_path, prompts, quantize_lm_head=True), _last_logits(qwen3_path, prompts))


def test_ranks_scale_and_refine_their_vocabulary_rows_as_one_rank_does(ray_cluster, qwen3_path):
    """tp 2 greedy tokens are tp 1's. Each rank computes its own shard's largest logits again, so at tp 2 more
    of the tail's logits are exact than at tp 1 (each rank's 16 of this tiny vocabulary's 180 a shard): the
    chosen tokens' logprobs agree to that tail's FP8 rounding (0.006 measured), not to float32's."""
    prompts = [[3 + i, 50 + i, 11, 70 + 2 * i] for i in range(4)]
    params = greedy(12, ignore_eos=True, logprobs=0)
    runs = []
    for tp_size in (2, 1):
        with checked_llm(qwen3_path, tp_size=tp_size, page_size=4, quantization="fp8", quantize_lm_head=True) as llm:
            runs.append(llm.generate(prompts, params))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    flat = [[x for o in run for x in o.logprobs] for run in runs]
    assert flat[0] == pytest.approx(flat[1], abs=2e-2)


def _e4m3_head(vocab: int, tp: TPGroup, seed: int, hidden: int = 32) -> tuple[torch.Tensor, ParallelLMHead]:
    """A random head's whole weight, and the head of `tp`'s rank over it made e4m3 as quantize_lm_head does."""
    torch.manual_seed(seed)
    full = torch.randn(vocab, hidden)
    head = ParallelLMHead(vocab, hidden, tp)
    head.weight_loader(head.weight, full)
    quantize_lm_head(SimpleNamespace(lm_head=head))
    return full, head


def test_the_last_ranks_padding_rows_are_never_refined_candidates():
    """tp 4 over a vocabulary of 157: the last rank's shard holds 37 rows and 3 of padding, whose logits are
    0. With all but a few of the shard's real logits negative the padding would take three of the 16 places;
    16 real rows are still computed again over the unquantized rows, the largest among them."""
    full, head = _e4m3_head(157, TPGroup(3, 4), seed=0)
    x = -full[120:].mean(0, keepdim=True) * 4
    exact = x @ full[120:].T
    assert (exact > 0).sum() < REFINED_CANDIDATES - 3
    got = head(x)[:, :37]  # the shard's own logits: a TPGroup without collectives gathers nothing
    refined = (got - exact).abs() <= 1e-5 * exact.abs().max()
    assert int(refined.sum()) == REFINED_CANDIDATES  # 16 real rows computed again (13 if padding took 3)
    top = exact.topk(8).indices
    assert refined.gather(1, top).all()


def test_above_a_few_rows_the_head_multiplies_its_unquantized_rows():
    """Where a step has more rows than E4M3_HEAD_MAX_ROWS the head's read is a small share of it and the
    top-k over the vocabulary would cost more than the halved read saves: the logits are the unquantized
    head's; up to it, the e4m3 head's, refined."""
    full, head = _e4m3_head(300, TPGroup(0, 1), seed=1)
    x = torch.randn(E4M3_HEAD_MAX_ROWS + 1, full.shape[1])
    torch.testing.assert_close(head(x), x @ full.T, rtol=1e-5, atol=1e-5)
    small = head(x[:E4M3_HEAD_MAX_ROWS])
    assert not torch.allclose(small, x[:E4M3_HEAD_MAX_ROWS] @ full.T, rtol=1e-3, atol=1e-3)  # the tail rounded
    top = (x[:E4M3_HEAD_MAX_ROWS] @ full.T).topk(4, dim=-1).indices
    torch.testing.assert_close(small.gather(1, top), (x[:E4M3_HEAD_MAX_ROWS] @ full.T).gather(1, top))


def test_batch_1_decode_reads_the_e4m3_head_through_the_fp8_gemv(qwen3_path, tmp_path, monkeypatch):
    """Under Triton's interpreter one prompt's head is the FP8 GEMV over the e4m3 rows (at a batch of
    several, cuBLASLt's scaled GEMM on a GPU, the dequantized product here)."""
    pytest.importorskip("triton")
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")
    ref = write_rounded_projections(qwen3_path, tmp_path / "ref")
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


def test_the_real_model_with_an_e4m3_head_answers_its_factual_questions(smollm2_path):
    """SmolLM2 (its head tied to its embeddings) quantized at load, the head too: its largest logits are the
    unquantized head's, and each answer names its word within its first dozen tokens. Without the refined
    candidates the e4m3 head's rounding (0.041 of the logits' norm) turned the first token of the answer
    about France."""
    from test_real_model import QUESTIONS, chat_ids

    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_path))
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    _assert_refined(_last_logits(smollm2_path, prompts, quantize_lm_head=True), _last_logits(smollm2_path, prompts))
    with checked_llm(smollm2_path, page_size=16, num_pages=256, quantization="fp8", quantize_lm_head=True) as llm:
        outs = llm.generate(prompts, greedy(12))
    for (question, word), out in zip(QUESTIONS.items(), outs):
        assert word in tokenizer.decode(out.token_ids), question


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
