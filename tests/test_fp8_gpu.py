"""FP8 weights on the GPU (compute capability 8.9+): each GEMM against float32 over the dequantized weight,
and engines over FP8 weights (quantized at load, and both published formats) against float32 references.

Tolerances. A weight dequantized is the reference's weight exactly, so a GEMM's error is its activations'
rounding to e4m3 (per token, or per token and 128 columns: at most 2^-4 of each value, about 2^-6 of an
output's size on average over thousands of terms) and its bf16 output (2^-9): ACT_TOL = 3% of the output's
norm bounds the first, and against the same activations rounded by the torch path, OUT_TOL = 1% the second
(the GEMV keeps bf16 activations: OUT_TOL against float32). Measured on an H200: see each test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoints import write_fp8_checkpoint
from helpers import checked_llm, greedy
from tiny_checkpoints import build_qwen3_hd128, random_prompts

from worker import skinny_gemm
from worker.kernels import Kernels
from worker.quant import gemm
from worker.quant.fp8 import dequantize, quantize_per_channel

pytestmark = pytest.mark.gpu
ACT_TOL, OUT_TOL = 0.03, 0.01
CUDA = "cuda"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _weights(n: int, k: int, block: tuple[int, int] | None):
    torch.manual_seed(n + k)
    w = torch.randn(n, k, device=CUDA) * 0.02
    if block is None:
        q, s = quantize_per_channel(w)
        return q, s
    from fp8_checkpoints import quantize_blocks

    q, s = quantize_blocks(w.cpu(), block)
    q, s = q.to(CUDA), s.to(CUDA)
    rows = s.repeat_interleave(block[0], dim=0)[:n].contiguous()  # the layer's layout: a row per output row
    return q, rows


@pytest.fixture(autouse=True)
def fp8_gpu():
    if not gemm.fp8_supported(torch.device(CUDA)):
        pytest.skip("needs compute capability 8.9+")


@pytest.mark.parametrize("m", [2, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(1536, 1024), (4096, 4096)])
def test_scaled_mm_with_per_token_activations_is_float32_over_the_dequantized_weight(m, n, k):
    q, s = _weights(n, k, None)
    x = torch.randn(m, k, device=CUDA).bfloat16()
    w = dequantize(q, s, None)
    got = gemm.fp8_linear(x, q, s, None)
    assert gemm.scaled_mm_applies(x, q) and got.dtype == torch.bfloat16
    assert _rel(got, x.float() @ w.T) < ACT_TOL
    xq, xs = gemm.quantize_activations_torch(x, k)
    assert _rel(got, (xq.float() * xs) @ w.T) < OUT_TOL


@pytest.mark.parametrize("m", [2, 64, 300])
@pytest.mark.parametrize("dtype,n", [(torch.float16, 4096), (torch.bfloat16, 4100)])
def test_products_cublaslt_cannot_take_are_float32_over_the_dequantized_weight(m, dtype, n, monkeypatch):
    # cuBLASLt's rowwise-scaled GEMM writes only bf16 and takes widths of multiples of 16 (an LM head's
    # vocabulary shard may not be one): these take the Triton GEMM, the weight never widened
    q, s = _weights(n, 4096, None)
    x = torch.randn(m, 4096, device=CUDA).to(dtype)
    w = dequantize(q, s, None)
    monkeypatch.setattr(gemm, "dequantized_linear", lambda *a: pytest.fail("the FP8 weight was widened"))
    got = gemm.fp8_linear(x, q, s, None)
    assert got.dtype == dtype
    assert _rel(got, x.float() @ w.T) < ACT_TOL
    xq, xs = gemm.quantize_activations_torch(x, 4096)
    assert _rel(got, (xq.float() * xs) @ w.T) < OUT_TOL


def test_an_fp16_engine_over_fp8_weights_generates_near_float32s_logits(hd128):
    # against float32 over the same (dequantized) weights, the cap of the bf16 engines' test below: the error
    # is e4m3's rounding of the activations (bf16 engines measured 0.127-0.129), fp16's output rounding finer
    prompts = random_prompts(4, 20, 200, seed=5)
    ref = _at_load_reference(hd128, prompts)
    err = _rel(_prefill_logits(hd128, prompts, dtype="float16", quantization="fp8"), ref)
    print(f"fp16 over fp8 weights {err:.4f}")
    assert err < 0.2
    with checked_llm(hd128, dtype="float16", quantization="fp8", page_size=16, num_pages=1024) as llm:
        assert llm.engine.graphs is not None
        outs = llm.generate(prompts, greedy(16, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [16] * 4


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m", [2, 16, 33, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_the_triton_fp8_gemm_agrees_with_cublaslt_and_repeats_exactly(m, n, k, split_k):
    """The per-channel product at decode's row counts (skinny_gemm.SKINNY_MAX_ROWS) through the Triton GEMM,
    split over K or not, against cuBLASLt's on the same e4m3 operands; a split sum is the same bits on
    every launch (its last program adds the partials in K's order) and leaves its counts at zero."""
    q, s = _weights(n, k, None)
    xq, xs = gemm.quantize_activations(torch.randn(m, k, device=CUDA).bfloat16(), k)
    want = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.float32)
    base = skinny_gemm._fit(skinny_gemm.mm_tile(m, n, k, 1), 1, q.device)
    tile = skinny_gemm.MmTile(base.block_m, base.block_n, base.block_k, split_k, base.num_warps, base.num_stages)
    got = [skinny_gemm.matmul(xq, q, torch.bfloat16, xs, s, tile=tile) for _ in range(3)]
    assert _rel(got[0], want) < 0.005
    assert all(torch.equal(got[0], g) for g in got[1:])
    assert not skinny_gemm._split_counts(torch.device(CUDA)).any()


@pytest.mark.parametrize("m", [129, 200, 256])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288)])
def test_the_triton_fp8_gemm_at_full_decode_batches_agrees_with_cublaslt(m, n, k):
    """Past SKINNY_MAX_ROWS, Qwen3-8B's o and down shapes at their default tile (skinny_gemm.FULL_BATCH_TILE,
    partial 64-row tiles included) against cuBLASLt on the same e4m3 operands, the same bits twice."""
    q, s = _weights(n, k, None)
    xq, xs = gemm.quantize_activations(torch.randn(m, k, device=CUDA).bfloat16(), k)
    assert skinny_gemm.pays(m, q) and skinny_gemm.mm_tile(m, n, k, 1).block_m == 64
    want = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.float32)
    got = skinny_gemm.matmul(xq, q, torch.bfloat16, xs, s)
    assert _rel(got, want) < 0.005
    assert torch.equal(skinny_gemm.matmul(xq, q, torch.bfloat16, xs, s), got)


@pytest.mark.parametrize("m", [2, 16, 64, 128])
def test_the_triton_gemm_over_bf16_agrees_with_cublas(m):
    """The same kernel over bf16 operands without scales (Kernels.decode_gemm for bf16 linears), split over K
    where its tile splits, against cuBLAS, on Qwen3-8B's o and down shapes."""
    for n, k in ((4096, 4096), (4096, 12288)):
        torch.manual_seed(m + k)
        x, w = torch.randn(m, k, device=CUDA).bfloat16(), (torch.randn(n, k, device=CUDA) * 0.02).bfloat16()
        got = skinny_gemm.matmul(x, w, torch.bfloat16)
        assert _rel(got, x.float() @ w.float().T) < OUT_TOL
        assert torch.equal(skinny_gemm.matmul(x, w, torch.bfloat16), got)
        assert not skinny_gemm._split_counts(torch.device(CUDA)).any()


def test_split_products_on_two_streams_at_once_keep_their_own_counts():
    """Two engines on one GPU (a draft model beside its target) launch on streams of their own, at once:
    each stream's split products count in a buffer of its own, so both come out right, launch after
    launch, and leave their counts at zero."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 4096, device=CUDA).bfloat16(), (torch.randn(4096, 4096, device=CUDA) * 0.02).bfloat16()
    tiles = [skinny_gemm.MmTile(16, 32, 128, split) for split in (2, 4)]
    want = [skinny_gemm.matmul(x, w, torch.bfloat16, tile=t) for t in tiles]
    streams = [torch.cuda.Stream() for _ in tiles]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for i, (s, t) in enumerate(zip(streams, tiles)):
        with torch.cuda.stream(s):
            torch.cuda._sleep(1_000_000)  # both streams' launches queue up behind it, then run side by side
            outs[i] = [skinny_gemm.matmul(x, w, torch.bfloat16, tile=t) for _ in range(200)]
    torch.cuda.synchronize()
    for i, s in enumerate(streams):
        assert all(torch.equal(o, want[i]) for o in outs[i])
        with torch.cuda.stream(s):
            assert not skinny_gemm._split_counts(torch.device(CUDA)).any()
    assert not skinny_gemm._split_counts(torch.device(CUDA)).any()


def test_per_channel_fp8_products_take_the_triton_gemm_at_decode_batches_and_cublaslt_above():
    """gemm.scaled_mm_quantized by Kernels.decode_gemm: triton, the Triton GEMM where skinny_gemm.pays (N =
    4,096 up to FULL_BATCH_ROWS rows, N = 6,144 up to SKINNY_MAX_ROWS, N = 24,576 up to 64) and cuBLASLt past
    it; auto, the same if FP8 is one of AUTO_DTYPES and cuBLASLt if not; vendor, cuBLASLt at every row count
    (each the same bits as the product it names)."""
    skinny, auto = skinny_gemm.SKINNY_MAX_ROWS, torch.float8_e4m3fn in skinny_gemm.AUTO_DTYPES
    full = skinny_gemm.FULL_BATCH_ROWS
    cases = [
        (4096, skinny, "triton", True),
        (4096, skinny + 1, "triton", True),
        (4096, full, "triton", True),
        (4096, full + 1, "triton", False),
        (6144, skinny, "triton", True),
        (6144, skinny + 1, "triton", False),
        (24576, 64, "triton", True),
        (24576, 65, "triton", False),
        (4096, 8, "vendor", False),
        (4096, 8, "auto", auto),
    ]
    for n, m, choice, triton in cases:
        q, s = _weights(n, 4096, None)
        xq, xs = gemm.quantize_activations(torch.randn(m, 4096, device=CUDA).bfloat16(), 4096)
        got = gemm.scaled_mm_quantized(xq, xs, q, s, torch.bfloat16, Kernels(decode_gemm=choice))
        if triton:
            want = skinny_gemm.matmul(xq, q, torch.bfloat16, xs, s)
        else:
            want = torch._scaled_mm(
                xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True
            )
        assert torch.equal(got, want), (n, m, choice)


@pytest.mark.parametrize("m", [2, 16, 33, 200])
@pytest.mark.parametrize("n,k", [(320, 576), (4096, 4096), (4096, 12288)])
def test_block_scaled_triton_gemm_is_float32_over_the_dequantized_weight(m, n, k):
    # 320 rows and 576 columns: partial blocks at both ends; 4096 x 12288 (down's shape): split over K at 16
    # rows or fewer
    q, s = _weights(n, k, (128, 128))
    x = torch.randn(m, k, device=CUDA).bfloat16()
    w = dequantize(q, s, (128, 128))
    got = gemm.fp8_linear(x, q, s, (128, 128))
    assert _rel(got, x.float() @ w.T) < ACT_TOL
    xq, xs = gemm.quantize_activations_torch(x, 128)
    assert _rel(got, (xq.float() * xs.repeat_interleave(128, dim=1)[:, :k]) @ w.T) < OUT_TOL


# block scales loaded for every weight, and a block at a time (`grouped`)
@pytest.mark.parametrize("block,grouped", [(None, False), ((128, 128), False), ((128, 128), True)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (12288, 4096), (4096, 12288), (300, 200)])
def test_fp8_gemv_at_one_row_is_float32_over_the_dequantized_weight(block, grouped, n, k):
    q, s = _weights(n, k, block)
    x = torch.randn(1, k, device=CUDA).bfloat16()
    got = gemm.fp8_gemv(x, q, s, block, grouped=grouped)
    assert _rel(got, x.float() @ dequantize(q, s, block).T) < OUT_TOL
    if block is None or grouped == gemm.GROUPED_BLOCK_SCALES:  # the layer's path
        assert torch.equal(gemm.fp8_linear(x, q, s, block), got)
    for gated in (False, True) if block is not None else ():  # both scale loads: bf16 outputs a step apart
        want = gemm.fp8_gemv(x, q, s, block, gated=gated, grouped=not grouped).float()
        assert _rel(gemm.fp8_gemv(x, q, s, block, gated=gated, grouped=grouped), want) < 2e-3


def test_the_triton_activation_quantization_is_the_torch_paths():
    torch.manual_seed(0)
    x = (torch.randn(37, 4096, device=CUDA) * 3).bfloat16()
    for group in (128, 4096):
        q, s = gemm.quantize_activations(x, group)
        want_q, want_s = gemm.quantize_activations_torch(x, group)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
        assert (q.float() == want_q.float()).float().mean() > 0.999  # a division's last bit may round apart


def _fp8_layer(cls, n: int, k: int):
    from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from worker.parallel import TPGroup
    from worker.quant.fp8 import Fp8Weights
    from worker.quant.scheme import Fp8Scheme

    torch.manual_seed(n + 3 * k)
    layer = (
        ColumnParallelLinear(k, [n], bias=False, tp=TPGroup(0, 1))
        if cls == "column"
        else RowParallelLinear(k, n, bias=False, tp=TPGroup(0, 1))
    ).to(CUDA)
    layer.weight.data = (torch.randn(n, k, device=CUDA) * 0.02).bfloat16()
    Fp8Weights.attach(layer, Fp8Scheme(prequantized=False))
    return layer


@pytest.mark.parametrize("rows", [2, 64, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_norm_with_the_quantization_inside_gives_the_unfused_norm_and_linear(rows, with_residual):
    """At more than one row an FP8 linear's input is quantized inside the residual norm before it
    (worker/quant/fused_quant.py, by norm_linear): the new residual, the per-token scales and e4m3 rows,
    and the linear's output are the unfused path's (FlashInfer's norm, the Triton quantization,
    cuBLASLt)."""
    from worker.layers.norm import RMSNorm
    from worker.layers.row_fusion import norm_linear
    from worker.quant import fused_quant

    layer = _fp8_layer("column", 1536, 4096)
    norm = RMSNorm(4096, 1e-6).to(CUDA)
    norm.weight.data = (1 + 0.3 * torch.randn(4096, device=CUDA)).bfloat16()
    x, residual = ((torch.randn(rows, 4096, device=CUDA) * 2).bfloat16() for _ in range(2))
    assert fused_quant.applies(layer, x, Kernels())
    given = residual.clone() if with_residual else None
    xq, xs, new_residual = fused_quant.norm_quant(x.clone(), given, norm.weight, 1e-6)
    normed, want_residual = norm(x.clone(), residual.clone()) if with_residual else (norm(x.clone()), x)
    assert torch.equal(new_residual, want_residual)
    want_q, want_s = gemm.quantize_activations(normed.contiguous(), 4096)
    torch.testing.assert_close(xs, want_s, rtol=2**-7, atol=0)  # the largest normed value, a bf16 ulp apart
    assert (xq.float() == want_q.float()).float().mean() > 0.999  # a product's last bit may round apart
    y, _, _ = norm_linear(norm, layer, x.clone(), residual.clone() if with_residual else None, Kernels())
    assert _rel(y, layer.quant.apply(layer, normed, None, True).float()) < OUT_TOL


@pytest.mark.parametrize("rows", [2, 64, 256])
def test_silu_with_the_quantization_inside_gives_the_unfused_silu_and_down(rows):
    from worker.layers.fused import fused_ops
    from worker.layers.row_fusion import silu_linear
    from worker.quant import fused_quant

    layer = _fp8_layer("row", 4096, 12288)
    gate_up = (torch.randn(rows, 2 * 12288, device=CUDA) * 3).bfloat16()
    h = fused_ops(gate_up).silu_and_mul(gate_up)
    xq, xs = fused_quant.silu_quant(gate_up)
    want_q, want_s = gemm.quantize_activations(h.contiguous(), 12288)
    torch.testing.assert_close(xs, want_s, rtol=2**-7, atol=0)
    assert (xq.float() == want_q.float()).float().mean() > 0.99
    y = silu_linear(layer, gate_up, Kernels())
    assert y is not None and _rel(y, layer(h).float()) < OUT_TOL


def test_fp8_gemms_run_inside_a_cuda_graph():
    q, s = _weights(1024, 1024, None)
    qb, sb = _weights(1024, 1024, (128, 128))
    x = torch.randn(8, 1024, device=CUDA).bfloat16()
    eager = [gemm.fp8_linear(x, q, s, None), gemm.fp8_linear(x, qb, sb, (128, 128)), gemm.fp8_linear(x[:1], q, s, None)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [
            gemm.fp8_linear(x, q, s, None),
            gemm.fp8_linear(x, qb, sb, (128, 128)),
            gemm.fp8_linear(x[:1], q, s, None),
        ]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, outs))


@pytest.fixture(scope="module")
def hd128(tmp_path_factory):
    return build_qwen3_hd128(tmp_path_factory.mktemp("qwen3_hd128_fp8w"))


def _at_load_reference(path, prompts) -> torch.Tensor:
    """The float32 reference for quantization at load: the model over its own weights, dequantized."""
    return _prefill_logits(path, prompts, _dequantize_own_weights, dtype="float32")


def _dequantize_own_weights(llm) -> None:
    for mod in llm.engine.model.modules():
        if hasattr(mod, "quant") and mod.weight.dim() == 2:
            q, s = quantize_per_channel(mod.weight.data)
            mod.weight.data.copy_(dequantize(q, s, None))


def _prefill_logits(path, prompts, prepare=None, **kw) -> torch.Tensor:
    """Each prompt's last logits, one prompt at a time; `prepare(llm)` first where given."""
    kw = {"dtype": "bfloat16", "page_size": 16, "num_pages": 1024, "max_running_reqs": 16, **kw}
    with checked_llm(path, **kw) as llm:
        if prepare is not None:
            prepare(llm)
        rows = []
        compute_logits = llm.engine.model.compute_logits
        llm.engine.model.compute_logits = lambda h: rows.append(compute_logits(h).float()) or rows[-1]
        for p in prompts:
            llm.generate([p], greedy(1))
        return torch.stack([r[-1].cpu() for r in rows])


@pytest.mark.parametrize(
    "fmt,decode_gemm",
    [
        ("at load", "auto"),
        ("fp8", "auto"),
        ("compressed-tensors", "auto"),
        ("compressed-tensors-block", "auto"),
        ("compressed-tensors-static", "auto"),
        ("fp8-static", "auto"),
        ("at load", "triton"),
        ("at load", "vendor"),
    ],
)
def test_an_fp8_engine_generates_and_its_logits_are_near_float32s(hd128, tmp_path, fmt, decode_gemm):
    # against float32 over the same (dequantized) weights; a bf16 engine's error on the same reference is
    # the yardstick: FP8's activations round 16 times coarser than bf16's. decode_gemm auto and triton: the
    # per-channel products of these prompts (20-200 tokens, every layer of hd128 at most 4,096 wide) and of every
    # decode step through the Triton GEMM (skinny_gemm.pays); vendor: all of them through cuBLASLt
    if fmt == "at load":
        path, ref_path, kw = hd128, None, {"quantization": "fp8"}
    else:
        path, ref_path = write_fp8_checkpoint(hd128, tmp_path, fmt)
        kw = {}
    kw["kernels"] = Kernels(decode_gemm=decode_gemm)
    prompts = random_prompts(8, 20, 200, seed=3)
    if ref_path is None:
        ref = _at_load_reference(hd128, prompts)
    else:
        ref = _prefill_logits(ref_path, prompts, dtype="float32")
    got = _prefill_logits(path, prompts, **kw)
    bf16 = _prefill_logits(ref_path or hd128, prompts)
    err, bf16_err = _rel(got, ref), _rel(bf16, ref)
    print(f"{fmt}: fp8 {err:.4f}, bf16 {bf16_err:.4f}")
    # the cap: on an H200 (2026-12-02) all three formats measured 0.127-0.129 against bf16's 0.016 (8x, within
    # the 16x that e4m3's three mantissa bits allow); 0.1 had been a guess made before any run
    assert err < max(16 * bf16_err, 0.02) and err < 0.2
    with checked_llm(path, dtype="bfloat16", page_size=16, num_pages=1024, max_running_reqs=16, **kw) as llm:
        assert llm.engine.graphs is not None
        outs = llm.generate(prompts + prompts[:1], greedy(24, ignore_eos=True))  # batch 9, then 1 alone
        alone = llm.generate(prompts[:1], greedy(24, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [24] * 9 and len(alone[0].token_ids) == 24


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors", "compressed-tensors-block", "fp8-static"])
def test_an_fp8_mixture_keeps_its_experts_e4m3_on_the_gpu(fmt, tmp_path):
    """A tiny Qwen3-MoE FP8 checkpoint on the GPU in bf16 (torch attention: its head size has no FlashInfer
    kernels): the experts stay e4m3 beside their rows' scales, standing for the dequantized reference's
    (rounded to bf16 as the reference's are); the attention runs FP8; the prompt steps' logits within the
    FP8 tolerance of the dense formats' test above (against the reference in float32, at most 16 times
    bf16's own error); batch-1 generation through the per-row expert kernels runs (eagerly: torch attention
    takes no CUDA graphs; test_fp8_expert_kernels_... replays the kernels in one)."""
    from tiny_checkpoints import build_checkpoint

    path, ref_path = write_fp8_checkpoint(build_checkpoint("qwen3_moe", tmp_path / "src"), tmp_path, fmt)
    torch_attention = {"kernels": Kernels(attention="torch")}
    prompts = random_prompts(4, 8, 40, seed=5)
    kw = {"dtype": "bfloat16", "num_pages": 1024, **torch_attention}
    with checked_llm(path, **kw) as llm, checked_llm(ref_path, **kw) as ref:
        layers = zip(llm.engine.model.model.layers, ref.engine.model.model.layers)
        for got, want in [(m.mlp.experts, r.mlp.experts) for m, r in layers if hasattr(m.mlp, "experts")]:
            scales = got.scales()
            for q, s, w in (
                (got.gate_up_proj.weight, scales.gate_up, want.gate_up_proj.weight),
                (got.down_proj.weight, scales.down, want.down_proj.weight),
            ):
                assert q.dtype == torch.float8_e4m3fn
                assert torch.equal((q.float() * s.repeat_interleave(q.shape[-1], dim=-1)).to(w.dtype), w)
        assert llm.engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        outs = [llm.generate([p], greedy(8, ignore_eos=True))[0].token_ids for p in prompts]
    assert all(len(o) == 8 for o in outs)
    want = _prefill_logits(ref_path, prompts, dtype="float32", **torch_attention)
    err = _rel(_prefill_logits(path, prompts, **torch_attention), want)
    bf16_err = _rel(_prefill_logits(ref_path, prompts, **torch_attention), want)
    assert err < max(16 * bf16_err, 0.02) and err < 0.2


def test_a_mixture_quantized_at_load_keeps_its_logits_and_serves(tmp_path):
    """quantization fp8 on a tiny Qwen3-MoE in bf16: every linear and the experts e4m3 (a scale a row); the
    prompt steps' logits within the FP8 tolerance of the checkpoint's own in float32; greedy decoding at
    batch 1 and at 9 (the per-row and the grouped expert kernels) runs."""
    from tiny_checkpoints import build_checkpoint

    path = build_checkpoint("qwen3_moe", tmp_path / "src")
    kw = {"kernels": Kernels(attention="torch")}
    prompts = random_prompts(9, 8, 40, seed=7)
    with checked_llm(path, dtype="bfloat16", num_pages=1024, quantization="fp8", **kw) as llm:
        blocks = [m.mlp.experts for m in llm.engine.model.model.layers if hasattr(m.mlp, "experts")]
        assert blocks and all(b.gate_up_proj.weight.dtype == torch.float8_e4m3fn for b in blocks)
        assert all(b.scales().gate_up_group == 0 for b in blocks)
        outs = llm.generate(prompts, greedy(12, ignore_eos=True))
        alone = llm.generate(prompts[:1], greedy(12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12] * 9 and len(alone[0].token_ids) == 12
    want = _prefill_logits(path, prompts[:4], dtype="float32", **kw)
    err = _rel(_prefill_logits(path, prompts[:4], quantization="fp8", **kw), want)
    bf16_err = _rel(_prefill_logits(path, prompts[:4], **kw), want)
    # the weights' own rounding to e4m3 counts here (a checkpoint's test compares with its dequantized weights)
    assert err < max(16 * bf16_err, 0.02)


# Qwen3-30B-A3B's expert shapes (one rank's slice at tp 1)
_MOE = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("tokens,at_once", [(1, True), (1, False), (4, True), (5, True), (64, True), (300, True)])
def test_fp8_expert_kernels_agree_with_the_torch_loop_over_their_weights(tokens, at_once, group, monkeypatch):
    """The fused paths over e4m3 experts at Qwen3-30B-A3B's shapes (the per-row kernels, their down
    kernel's loop over choices too, and the grouped GEMMs), a scale a row or a scale for each 128 columns:
    against the torch loop in float32 over the weights they stand for, within bf16's tolerance of the MoE
    kernels' bf16 test (2% of the largest output; FP8's 8% where the grouped GEMMs quantize their
    activations, where they also run with the weights widened at 2%); and one launch captured in a CUDA
    graph replays."""
    from worker.layers.moe import fused
    from worker.layers.moe.routing import select_experts
    from worker.layers.moe.torch_experts import torch_experts

    if not at_once:
        monkeypatch.setattr(fused, "PER_ROW_DOWN_AT_ONCE", None)
    e, k, i = _MOE["num_experts"], _MOE["top_k"], _MOE["inter"]
    x, logits, (q13, w13), (q2, w2), scales = _moe_case(tokens, group)
    want = torch_experts(x.float(), w13, w2, *select_experts(logits.float(), k, True))
    got = fused.fused_moe(x, logits, q13, q2, k, True, scales=scales)
    # the grouped GEMMs over a scale a row quantize their activations (the test below): FP8's tolerance there
    grouped = not fused.per_row_applies(tokens * k, e)
    w8a8 = grouped and fused.w8a8_applies(scales, fused._block_m(tokens * k, e), x, i)
    assert (got.float() - want).abs().max() <= (0.08 if w8a8 else 0.02) * want.abs().max()
    if w8a8:  # the grouped GEMMs widening these weights to bf16 instead (as they do a block-scaled checkpoint's)
        routing = select_experts(logits, k, True)
        widened = fused.fused_experts(x, q13, q2, *routing, per_row=False, scales=scales, w8a8=False)
        assert (widened.float() - want).abs().max() <= 0.02 * want.abs().max()
    _replays_in_a_graph(x, logits, q13, q2, scales)


@pytest.mark.parametrize("tokens", [64, 256, 1024, 2048])
def test_the_grouped_gemms_fp8_experts_multiply_e4m3_activations_as_the_torch_loop_over_them(tokens):
    """At a decode batch's and a prompt chunk's block heights the grouped GEMMs over e4m3 experts with a scale
    a row quantize their activations (x per token, silu(gate) * up per row) and multiply on the FP8 tensor
    cores: against the torch loop in float32 over the same rounded activations within 4% of the largest
    output (bf16's 2%, and the elements of h that round to the next e4m3 value on one side only), and within
    FP8's 8% of the exact activations' output; a CUDA graph replays it."""
    from worker.layers.moe import fused
    from worker.layers.moe.routing import select_experts
    from worker.layers.moe.torch_experts import torch_experts
    from worker.quant.gemm import quantize_activations_torch

    e, k, h, i = _MOE["num_experts"], _MOE["top_k"], _MOE["hidden"], _MOE["inter"]
    x, logits, (q13, w13), (q2, w2), scales = _moe_case(tokens, 0)
    assert fused.w8a8_applies(scales, fused._block_m(tokens * k, e), x, i)
    weights, ids = select_experts(logits.float(), k, True)

    def rounded(a: torch.Tensor) -> torch.Tensor:  # as the kernels' inputs: e4m3 times its row's scale
        q, s = quantize_activations_torch(a, a.shape[1])
        return q.float() * s

    want = torch.zeros(tokens, h, device=CUDA)
    xr = rounded(x)
    for expert in range(e):
        token, choice = (ids == expert).nonzero(as_tuple=True)
        if not len(token):  # chosen by no token (a few at 64 tokens)
            continue
        gate, up = (xr[token] @ w13[expert].T).chunk(2, dim=-1)
        hr = rounded((torch.nn.functional.silu(gate) * up).to(torch.bfloat16))
        want.index_add_(0, token, (hr @ w2[expert].T) * weights[token, choice, None])
    got = fused.fused_moe(x, logits, q13, q2, k, True, scales=scales)
    assert (got.float() - want).abs().max() <= 0.04 * want.abs().max()
    exact = torch_experts(x.float(), w13, w2, weights, ids)
    assert (got.float() - exact).abs().max() <= 0.08 * exact.abs().max()
    _replays_in_a_graph(x, logits, q13, q2, scales)


def _moe_case(tokens: int, group: int):
    """Random bf16 tokens and router logits at _MOE's shapes, e4m3 experts with a scale a row (group 0) or each
    `group` columns: (x, logits, (w13 e4m3, the float32 w13 it stands for), (w2, likewise), ExpertScales)."""
    from worker.layers.moe.weights import ExpertScales

    e, h, i = _MOE["num_experts"], _MOE["hidden"], _MOE["inter"]
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, h, device=CUDA, generator=g).to(torch.bfloat16)
    (q13, s13, w13), (q2, s2, w2) = (
        _grouped_e4m3(torch.randn(e, 2 * i, h, device=CUDA, generator=g) * h**-0.5, group),
        _grouped_e4m3(torch.randn(e, h, i, device=CUDA, generator=g) * i**-0.5, group),
    )
    logits = torch.randn(tokens, e, device=CUDA, generator=g).to(torch.bfloat16)
    return x, logits, (q13, w13), (q2, w2), ExpertScales(s13, s2, group, group)


def _replays_in_a_graph(x, logits, q13, q2, scales) -> None:
    """fused_moe captured in a CUDA graph, replayed over new tokens, gives what a launch gives."""
    from worker.layers.moe import fused

    k = _MOE["top_k"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.fused_moe(x, logits, q13, q2, k, True, scales=scales)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fused.fused_moe(x, logits, q13, q2, k, True, scales=scales), atol=0, rtol=0)


def _grouped_e4m3(w: torch.Tensor, group: int):
    """w [E, N, K] -> (e4m3, scales [E, N, K / group] or [E, N, 1], the float32 weights they stand for)."""
    experts, rows, cols = w.shape
    width = group or cols
    blocks = w.view(experts, rows, cols // width, width)
    scale = (blocks.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(experts, rows, cols)
    return q, scale, q.float() * scale.repeat_interleave(width, dim=-1)


@pytest.mark.parametrize("rows", [1, 16, 256])
def test_an_e4m3_lm_head_is_float32_over_its_dequantized_rows_and_picks_the_unquantized_heads_token(rows):
    """quantize_lm_head on a head of Qwen3's vocabulary: one row through the FP8 GEMV (bf16 activations),
    small decode batches through the FP8 GEMMs (activations e4m3 a token), near float32 over the dequantized
    head; each row's largest logit (where no other is within bf16's rounding of it) is the unquantized head's
    token, its candidates computed again over the bf16 rows inside the same CUDA-graph-safe ops. Above
    E4M3_HEAD_MAX_ROWS the head is the product over the unquantized rows."""
    from types import SimpleNamespace

    from worker.layers.embedding import E4M3_HEAD_MAX_ROWS, ParallelLMHead
    from worker.parallel import TPGroup
    from worker.quant.prepare import quantize_lm_head

    vocab, hidden = 151_936, 1024
    torch.manual_seed(rows)
    head = ParallelLMHead(vocab, hidden, TPGroup(0, 1)).to(CUDA)
    head.weight.data = (torch.randn(vocab, hidden, device=CUDA) * 0.02).bfloat16()
    unquantized = head.weight.detach().float().clone()
    quantize_lm_head(SimpleNamespace(lm_head=head))
    assert head.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(rows, hidden, device=CUDA).bfloat16()
    got = head(x)
    assert got.shape == (rows, vocab)
    if rows > E4M3_HEAD_MAX_ROWS:
        assert torch.equal(got, F.linear(x, head.exact_weight))
    else:
        assert _rel(got, x.float() @ dequantize(head.weight, head.weight_scale, None).T) < ACT_TOL
    exact = (x.float() @ unquantized.T).topk(2, dim=-1)
    clear = exact.values[:, 0] - exact.values[:, 1] > 0.05
    assert torch.equal(got.argmax(-1)[clear], exact.indices[clear, 0])


def test_an_engine_with_an_e4m3_lm_head_decodes_near_its_bf16_heads_logits(hd128):
    prompts = random_prompts(9, 8, 40, seed=5)
    with checked_llm(hd128, dtype="bfloat16", num_pages=1024, quantization="fp8", quantize_lm_head=True) as llm:
        assert llm.engine.model.lm_head.weight.dtype == torch.float8_e4m3fn
        outs = llm.generate(prompts, greedy(12, ignore_eos=True))
        alone = llm.generate(prompts[:1], greedy(12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12] * 9 and len(alone[0].token_ids) == 12
    head = _prefill_logits(hd128, prompts[:4], quantization="fp8", quantize_lm_head=True)
    want = _prefill_logits(hd128, prompts[:4], quantization="fp8")
    assert 0 < _rel(head, want) < 0.06  # the head's own rounding to e4m3 (0.025 on the CPU's tiny Qwen3)
