"""The residual norms of an FP8 model at batch 1 without launches of their own: the residual add in the
epilogue of the GEMV before (o and down), the RMS norm inside the FP8 GEMV after (qkv and gate-up) in the
same pass over the row, and, where the weights are quantized at load, the norm's weight folded into them.
Kernels under Triton's interpreter against torch; the fold against the unfolded model; end to end against
the norms run apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import checked_llm, greedy
from tiny_checkpoints import random_prompts

from worker.kernels import Kernels
from worker.layers.norm import RMSNorm
from worker.quant import gemm
from worker.quant.fp8 import FP8, dequantize, quantize_per_channel
from worker.quant.prepare import quantize_linears
from worker.quant.scheme import Fp8Scheme

EPS = 1e-6


def _rms(h: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return normed if weight is None else normed * weight


def _needs_triton() -> None:
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")


# K past one step (block_k 128) and not a multiple of it; N past one program's rows and not a multiple
@pytest.mark.parametrize("k,n", [(300, 37), (64, 9)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_the_fp8_gemv_over_the_rms_norm_of_its_row_is_the_norm_then_the_dequantized_matmul(k, n, with_weight, gated):
    """rstd factors out of every output, so the one pass that reads the row sums its squares too: the same
    product as the norm first (in float32, unrounded) then the GEMV."""
    _needs_triton()
    torch.manual_seed(k + n)
    q, scale = quantize_per_channel(torch.randn(2 * n if gated else n, k) * 0.05)
    h = torch.randn(1, k) * 3
    weight = torch.rand(k) + 0.5 if with_weight else None
    got = gemm.fp8_gemv(h, q, scale, None, block_k=128, gated=gated, norm=gemm.RowNorm(weight, EPS))
    ref = _rms(h, weight) @ dequantize(q, scale, None).T
    if gated:
        ref = F.silu(ref[:, :n]) * ref[:, n:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])  # a scale loaded for every weight, or once a block
def test_the_fp8_gemv_over_block_scaled_weights_takes_the_norm_too(grouped):
    _needs_triton()
    from fp8_checkpoints import quantize_blocks

    torch.manual_seed(0)
    block, k, n = (16, 32), 200, 40
    q, s = quantize_blocks(torch.randn(n, k) * 0.05, block)
    s = s.repeat_interleave(block[0], dim=0)[:n].contiguous()
    h, weight = torch.randn(1, k), torch.rand(k) + 0.5
    got = gemm.fp8_gemv(h, q, s, block, block_k=64, grouped=grouped, norm=gemm.RowNorm(weight, EPS))
    torch.testing.assert_close(got, _rms(h, weight) @ dequantize(q, s, block).T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_added_in_the_fp8_gemvs_epilogue_is_the_rounded_product_plus_the_residual(dtype):
    """As the GEMV's output, rounded to its dtype, then the add, rounded again."""
    _needs_triton()
    torch.manual_seed(1)
    k, n = 300, 37
    q, scale = quantize_per_channel(torch.randn(n, k) * 0.05)
    x, res = torch.randn(1, k).to(dtype), torch.randn(1, n).to(dtype)
    plain = gemm.fp8_gemv(x, q, scale, None, block_k=128)
    got = gemm.fp8_gemv(x, q, scale, None, block_k=128, residual=res)
    assert got.dtype == dtype
    # exact in float32; in bfloat16 within a unit of the last place, as the interpreter rounds its casts
    # to bfloat16 its own way (not the GPU's round to nearest)
    ulp = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, (plain.float() + res.float()).to(dtype), rtol=ulp, atol=0)


def test_the_norm_and_the_residual_inside_the_fp8_gemv_take_one_row_and_a_row_of_its_outputs():
    _needs_triton()
    q, scale = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(ValueError, match="one row"):
        gemm.fp8_gemv(torch.randn(2, 16), q, scale, None, norm=gemm.RowNorm(None, EPS))
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        gemm.fp8_gemv(torch.randn(1, 16), q, scale, None, residual=torch.randn(1, 7))
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        gemm.fp8_gemv(torch.randn(1, 16), q, scale, None, gated=True, residual=torch.randn(1, 4))


# -- the fold at load ------------------------------------------------------------------------------------


def _last_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's next-token logits, one prompt a step."""
    rows = []
    compute_logits = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
    for p in prompts:
        llm.generate([p], greedy(1))
    llm.engine.model.compute_logits = compute_logits
    return torch.stack([r[-1] for r in rows])


def _draw_norm_weights(folder) -> None:
    """Every norm's weight in the checkpoint drawn from [0.25, 4) (transformers initializes them to ones,
    which a fold would leave as they are)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (4.0 ** (torch.rand(w.shape, generator=gen) * 2 - 1)).to(w.dtype)
    save_file(tensors, str(folder / "model.safetensors"))


def _with_drawn_norms(src, out):
    import shutil

    shutil.copytree(src, out, dirs_exist_ok=True)
    _draw_norm_weights(out)
    return out


@pytest.fixture(scope="module")
def weighted_norms(qwen3_path, tmp_path_factory):
    """The tiny Qwen3 with drawn norm weights."""
    return _with_drawn_norms(qwen3_path, tmp_path_factory.mktemp("weighted_norms"))


@pytest.fixture(scope="module")
def weighted_qwen2(qwen2_path, tmp_path_factory):
    """The tiny Qwen2 (a bias on q, k and v) with drawn norm weights."""
    return _with_drawn_norms(qwen2_path, tmp_path_factory.mktemp("weighted_qwen2"))


def test_folding_the_norms_into_the_weights_quantized_at_load_costs_no_accuracy(weighted_norms):
    """The folded model is the same function: its logits are as near the unquantized model's as the
    unfolded FP8 model's are, and only the input and post-attention norms become ones."""
    prompts = random_prompts(6, 4, 40, seed=3)
    qwen3_path = weighted_norms
    with checked_llm(qwen3_path, page_size=4) as llm:
        exact = _last_logits(llm, prompts)
        norms = {n: m.weight.clone() for n, m in llm.engine.model.named_modules() if isinstance(m, RMSNorm)}
    with checked_llm(qwen3_path, page_size=4, quantization="fp8", kernels=Kernels(fp8_norms="apart")) as llm:
        apart = _last_logits(llm, prompts)
    with checked_llm(qwen3_path, page_size=4, quantization="fp8", kernels=Kernels(fp8_norms="folded")) as llm:
        folded = _last_logits(llm, prompts)
        model = llm.engine.model
        for name, m in model.named_modules():
            if isinstance(m, RMSNorm):
                residual_norm = name.endswith(("input_layernorm", "post_attention_layernorm"))
                assert m.folded == residual_norm, name
                assert torch.equal(m.weight, torch.ones_like(m.weight) if residual_norm else norms[name]), name
        assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    err_apart = float((apart - exact).norm() / exact.norm())
    err_folded = float((folded - exact).norm() / exact.norm())
    assert 0 < err_apart < 0.3 and 0 < err_folded < 1.5 * err_apart and err_folded != err_apart, (err_apart, err_folded)


def test_a_quantized_checkpoint_is_not_folded():
    """Its weights would be rounded to e4m3 twice."""
    with pytest.raises(ValueError, match="quantized at load"):
        quantize_linears(torch.nn.Linear(2, 2), Fp8Scheme(prequantized=True), fold_norms=True)


def test_the_real_model_with_its_norms_folded_answers_its_factual_questions(smollm2_path):
    from test_real_model import QUESTIONS, chat_ids

    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_path))
    kernels = Kernels(fp8_norms="folded")
    with checked_llm(smollm2_path, page_size=16, num_pages=256, quantization="fp8", kernels=kernels) as llm:
        assert llm.engine.model.model.layers[0].input_layernorm.folded
        outs = llm.generate([chat_ids(tokenizer, q) for q in QUESTIONS], greedy(12))
    for (question, word), out in zip(QUESTIONS.items(), outs):
        assert word in tokenizer.decode(out.token_ids), question


# -- end to end through the interpreted kernels ------------------------------------------------------------


def _recorded(monkeypatch) -> list[dict]:
    """gemm.fp8_gemv's calls' keyword arguments, as the layers make them."""
    calls: list[dict] = []
    real = gemm.fp8_gemv

    def recorded(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(gemm, "fp8_gemv", recorded)
    return calls


@pytest.mark.parametrize("model", ["qwen3", "qwen2"])
@pytest.mark.parametrize("mode", ["inside", "folded"])
def test_batch_1_decode_with_the_norms_inside_the_fp8_gemvs_equals_them_apart(request, monkeypatch, model, mode):
    """One prompt under Triton's interpreter (slow), in float32: qkv's and gate-up's GEMVs compute the norm of
    the residual stream (with the norm's weight, or folded into theirs) that o's and down's add in their
    epilogues, and no residual norm runs on its own at one row; greedy tokens as the CPU's, which runs
    every norm apart before dequantized matmuls. Qwen2: qkv's bias added after the GEMV with the norm."""
    _needs_triton()
    path = request.getfixturevalue("weighted_norms" if model == "qwen3" else "weighted_qwen2")
    prompts = random_prompts(1, 4, 40, seed=2)
    with checked_llm(path, page_size=4, quantization="fp8", kernels=Kernels(fp8_norms=mode)) as llm:
        want = [llm.generate([p], greedy(4, ignore_eos=True))[0].token_ids for p in prompts]
    calls = _recorded(monkeypatch)
    rows_normed: list[tuple[RMSNorm, int]] = []
    forward = RMSNorm.forward
    monkeypatch.setattr(
        RMSNorm, "forward", lambda self, x, *a: rows_normed.append((self, x.shape[0])) or forward(self, x, *a)
    )
    kernels = Kernels(interpret_on_cpu=True, fp8_norms=mode)
    with checked_llm(path, page_size=4, quantization="fp8", kernels=kernels) as llm:
        layers = llm.engine.model.model.layers
        assert model == "qwen3" or layers[0].self_attn.qkv_proj.bias is not None
        residual_norms = {m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)}
        assert all(m.folded == (mode == "folded") for m in residual_norms)
        got = [llm.generate([p], greedy(4, ignore_eos=True))[0].token_ids for p in prompts]
    assert got == want
    normed = [kw["norm"] for kw in calls if kw.get("norm") is not None]
    assert normed and all((n.weight is None) == (mode == "folded") for n in normed)
    assert any(kw.get("norm") is not None and kw.get("gated") for kw in calls)  # gate-up
    assert any(kw.get("norm") is not None and not kw.get("gated") for kw in calls)  # qkv
    assert any(kw.get("residual") is not None for kw in calls)  # o and down
    assert not [m for m, rows in rows_normed if m in residual_norms and rows == 1]
    assert [m for m, rows in rows_normed if m in residual_norms and rows > 1]  # the prompt's, apart


def test_an_eagle3_head_beside_an_fp8_model_with_its_norms_inside_keeps_its_greedy_tokens(
    qwen3_path, tmp_path, monkeypatch
):
    """The head's engine takes the model's settings (its down projection quantized too), and its one layer's
    down GEMV adds the residual as the model's do: the head's final norm reads the one row it leaves.
    Speculation changes no greedy token: the model's own, from the CPU's norms apart."""
    _needs_triton()
    from tiny_checkpoints import build_eagle3_head

    head = build_eagle3_head(qwen3_path, tmp_path / "head", draft_vocab_size=300)
    prompt = random_prompts(1, 4, 10, seed=2)[0]
    with checked_llm(qwen3_path, page_size=4, quantization="fp8") as llm:
        want = llm.generate([prompt], greedy(3, ignore_eos=True))[0].token_ids
    calls = _recorded(monkeypatch)
    spec = dict(speculative_method="eagle3", speculative_model=str(head), num_speculative_tokens=2)
    spec.update(speculative_adaptive=False, speculative_max_pause=0)
    kernels = Kernels(interpret_on_cpu=True, fp8_norms="inside")
    with checked_llm(qwen3_path, page_size=4, quantization="fp8", kernels=kernels, **spec) as llm:
        got = llm.generate([prompt], greedy(3, ignore_eos=True))[0].token_ids
    assert got == want
    assert any(kw.get("residual") is not None for kw in calls)


# -- on the GPU ----------------------------------------------------------------------------------------------

CUDA = "cuda"


def _fp8_gpu() -> None:
    if not torch.cuda.is_available() or not gemm.fp8_supported(torch.device(CUDA)):
        pytest.skip("needs a GPU of compute capability 8.9+")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("block,grouped", [(None, False), ((128, 128), False), ((128, 128), True)])
@pytest.mark.parametrize("gated,n", [(False, 6144), (True, 12288)])  # Qwen3-8B's qkv and gate-up
def test_on_gpu_the_fp8_gemv_over_the_norm_of_its_row_equals_flashinfers_norm_then_the_gemv(block, grouped, gated, n):
    """The norm inside: the product of the normed row unrounded, against FlashInfer's norm rounded to bf16
    then the GEMV."""
    _fp8_gpu()
    from fp8_checkpoints import quantize_blocks

    torch.manual_seed(n)
    k, rows = 4096, 2 * n if gated else n
    w = torch.randn(rows, k) * 0.02
    if block is None:
        q, s = quantize_per_channel(w.to(CUDA))
    else:
        q, s = quantize_blocks(w, block)
        q, s = q.to(CUDA), s.repeat_interleave(block[0], dim=0)[:rows].contiguous().to(CUDA)
    norm = RMSNorm(k, EPS).to(CUDA)
    norm.weight.data.uniform_(0.25, 4.0)
    h = (torch.randn(1, k, device=CUDA) * 4).bfloat16()
    want = gemm.fp8_gemv(norm.to(torch.bfloat16)(h.clone()), q, s, block, gated=gated, grouped=grouped)
    row_norm = gemm.RowNorm(norm.weight.bfloat16(), EPS)
    got = gemm.fp8_gemv(h, q, s, block, gated=gated, grouped=grouped, norm=row_norm, pdl=True)
    # the unrounded normed row against one rounded to bf16 (2^-9 of each element) and both outputs' bf16
    # rounding: a few 2^-9 of the product's norm (1%: test_fp8_gpu.py's OUT_TOL)
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_on_gpu_the_residual_added_in_the_fp8_gemvs_epilogue_is_the_rounded_sum():
    _fp8_gpu()
    torch.manual_seed(0)
    k, n = 12288, 4096  # Qwen3-8B's down
    q, s = quantize_per_channel(torch.randn(n, k, device=CUDA) * 0.02)
    x, res = torch.randn(1, k, device=CUDA).bfloat16(), (torch.randn(1, n, device=CUDA) * 8).bfloat16()
    got = gemm.fp8_gemv(x, q, s, None, residual=res, pdl=True)
    want = gemm.fp8_gemv(x, q, s, None, pdl=True) + res
    torch.testing.assert_close(got, want, rtol=2**-8, atol=0)  # a bf16 unit of the last place at most


@pytest.mark.gpu
def test_on_gpu_an_fp8_engine_with_its_norms_inside_its_gemvs_decodes_as_with_them_apart(tmp_path_factory, monkeypatch):
    """Batch 1 with PDL, eagerly: each prompt's first decode step (after the same prompt step, so from the same
    token where the first tokens agree) against the norms apart: inside within bf16's roundings, folded (the
    weights quantized with the norms' weights in them) within FP8's. From CUDA graphs: the eager tokens."""
    _fp8_gpu()
    from tiny_checkpoints import build_qwen3_hd128

    path = build_qwen3_hd128(tmp_path_factory.mktemp("qwen3_hd128_norms"))
    _draw_norm_weights(path)
    prompts = random_prompts(6, 20, 200, seed=4)

    def run(mode: str, graphs: bool = False) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """Each prompt's greedy tokens alone (8), and (eager only) its prompt step's last logits and its first
        decode step's."""
        kw = {"dtype": "bfloat16", "page_size": 16, "num_pages": 512, "quantization": "fp8"}
        kw.update(kernels=Kernels(fp8_norms=mode), cuda_graph_max_bs=16 if graphs else 0)
        with checked_llm(path, **kw) as llm:
            rows = []
            compute_logits = llm.engine.model.compute_logits

            def recorded(h: torch.Tensor) -> torch.Tensor:
                logits = compute_logits(h)
                rows.append(logits.float().cpu())
                return logits  # on the device, for the sampler

            llm.engine.model.compute_logits = recorded
            tokens, firsts, steps = [], [], []
            for p in prompts:
                rows.clear()
                tokens.append(llm.generate([p], greedy(8, ignore_eos=True))[0].token_ids)
                if not graphs:
                    assert rows[1].shape[0] == 1  # the first decode step's row
                    firsts.append(rows[0][-1])
                    steps.append(rows[1][-1])
        return tokens, *(torch.stack(x) if x else torch.empty(0) for x in (firsts, steps))

    calls = _recorded(monkeypatch)
    apart_tokens, apart_first, apart = run("apart")
    assert not [kw for kw in calls if kw.get("norm") is not None or kw.get("residual") is not None]
    # a bf16 engine's logits are about 0.016 from float32's (test_fp8_gpu.py), FP8's about 0.13: inside
    # differs from apart by roundings of the bf16 kind, folded by its weights' own rounding to e4m3
    for mode, tol in (("inside", 0.05), ("folded", 0.3)):
        calls.clear()
        tokens, first, steps = run(mode)
        assert any(kw.get("norm") is not None for kw in calls) and any(kw.get("residual") is not None for kw in calls)
        assert _rel(first, apart_first) < tol, mode  # the prompt steps read the same tokens in every mode
        same = [i for i, (a, b) in enumerate(zip(apart_tokens, tokens)) if a[0] == b[0]]
        if mode == "inside":
            assert len(same) == len(prompts)  # the prompt steps take the same kernels
        # a random model's top logits lie close, so folded weights' own rounding may pick another first token
        # (2 of 6 agreed on an H100): the first decode steps compare where the first tokens agree
        if same:
            assert _rel(steps[same], apart[same]) < tol, mode
        assert run(mode, graphs=True)[0] == tokens, mode


def test_fp8_norms_auto_resolves_to_the_measured_placement_and_an_unknown_one_is_an_error(monkeypatch):
    from worker import kernels as kernels_module

    assert Kernels().fp8_norms_resolved == kernels_module.FP8_NORMS_AUTO
    monkeypatch.setattr(kernels_module, "FP8_NORMS_AUTO", "folded")
    assert Kernels().fp8_norms_resolved == "folded" and Kernels().fp8_norms_inside
    assert Kernels(fp8_norms="apart").fp8_norms_resolved == "apart" and not Kernels(fp8_norms="apart").fp8_norms_inside
    with pytest.raises(ValueError, match="unknown FP8 norm placement 'beside'"):
        Kernels(fp8_norms="beside")


def test_fp8_norms_auto_is_folded_for_weights_quantized_at_load_and_apart_for_a_quantized_checkpoint():
    """Inside (what folded is where nothing can be folded) was measured slower than apart."""
    assert Kernels().with_weights(quantized_at_load=True).fp8_norms == "folded"
    assert Kernels().with_weights(quantized_at_load=False).fp8_norms == "apart"
    assert Kernels(fp8_norms="inside").with_weights(quantized_at_load=False).fp8_norms == "inside"
