"""A mixture of experts' FP8 checkpoint in the published formats (transformers' block-scaled `fp8`, the
format of Qwen3-MoE's FP8 releases; compressed-tensors' per-channel FP8; the static ones with a scale a
weight, AutoFP8's being Mixtral's FP8 releases' format): its experts' e4m3 weights and
scales are read into the stacked expert parameters and dequantized there once loaded, each rank its slice;
its other linears stay FP8. Against transformers over the same weights dequantized to float32 (the tiny
checkpoints of tests/fp8_checkpoints.py): the stacked experts equal the reference's exactly, so greedy
tokens agree exactly on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from fixtures import hf_greedy
from fp8_checkpoints import FP8, dequantize_blocks, quantize_blocks, quantize_channels, write_fp8_checkpoint
from helpers import assert_tp2_equals_tp1, checked_llm, greedy
from tiny_checkpoints import build_checkpoint, random_prompts
from torch import nn

from worker.kernels import Kernels
from worker.layers.moe import select_experts
from worker.layers.moe.torch_experts import torch_experts
from worker.layers.moe.weights import Experts, ExpertScales
from worker.parallel import TPGroup
from worker.quant.experts import attach_expert_scales, dequantize_experts, keep_expert_scales
from worker.quant.fp8 import quantize_per_channel
from worker.quant.scheme import Fp8Scheme

# compressed-tensors' static format reads its experts as AutoFP8's does (a scale a weight; tests/test_fp8_weights.py
# reads both formats' configs)
FORMATS = ["fp8", "compressed-tensors", "compressed-tensors-block", "fp8-static"]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """Each format's (FP8 folder, dequantized reference folder) of a tiny Qwen3-MoE."""
    src = build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_src"))
    out = tmp_path_factory.mktemp("moe_fp8")
    return {fmt: write_fp8_checkpoint(src, out, fmt) for fmt in FORMATS}


def _experts(llm):
    return [m.mlp.experts for m in llm.engine.model.model.layers if hasattr(m.mlp, "experts")]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp8_mixtures_experts_are_its_dequantized_weights_and_its_tokens_transformers(moe_checkpoints, fmt, caplog):
    path, ref_path = moe_checkpoints[fmt]
    prompts = random_prompts(4, 4, 30, seed=2)
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        with checked_llm(path, page_size=4) as llm, checked_llm(ref_path, page_size=4) as ref:
            for got, want in zip(_experts(llm), _experts(ref), strict=True):
                assert torch.equal(got.gate_up_proj.weight, want.gate_up_proj.weight)
                assert torch.equal(got.down_proj.weight, want.down_proj.weight)
                assert not [n for n, _ in got.named_parameters() if "scale" in n]  # dropped once applied
            assert llm.engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
            outs = [o.token_ids for o in llm.generate(prompts, greedy(10, ignore_eos=True))]
    assert outs == hf_greedy(ref_path, prompts, 10, ignore_eos=True)
    assert any("are dequantized to torch.float32 at load" in r.getMessage() for r in caplog.records)


def test_a_mixtral_in_autofp8s_format_keeps_its_experts_e4m3_and_its_tokens_are_transformers(tmp_path):
    """Mixtral's FP8 releases: w1 / w3 / w2 and the attention e4m3 at a scale a weight, each with a calibrated
    `input_scale` (passed over), the routers left out by their checkpoint names (`block_sparse_moe.gate`)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    pytest.importorskip("triton")
    src = build_checkpoint("mixtral", tmp_path / "src")
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    for d in (fp8, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, reference, ignored = dict(tensors), dict(tensors), ["lm_head"]
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        part = module.rsplit(".", 1)[-1]
        if part == "gate":
            ignored.append(module)
        elif part in ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"):
            scale = w.float().abs().max() / 448.0
            q = (w.float() / scale).to(FP8)
            quantized[name], reference[name] = q, q.float() * scale
            quantized[f"{module}.weight_scale"], quantized[f"{module}.input_scale"] = scale, torch.tensor(0.02)
    assert len(ignored) == 3  # the two layers' routers
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(reference, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ignored}
    (fp8 / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(3, 4, 20, seed=1)
    with checked_llm(fp8, page_size=4, kernels=MOE_INTERPRETED) as llm, checked_llm(ref, page_size=4) as want:
        _assert_e4m3_standing_for(llm, want)
        assert all(layer.mlp.gate.weight.dtype == torch.float32 for layer in llm.engine.model.model.layers)
        outs = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert outs == hf_greedy(ref, prompts, 8, ignore_eos=True)


def test_an_fp8_mixture_at_tp2_equals_tp1(ray_cluster, moe_checkpoints):
    # per-channel scales: the tiny model's dense layers are narrower than a 128-wide block, which a
    # row-parallel shard may not start inside (the block format at tp 2 is refused for them, by name)
    assert_tp2_equals_tp1(moe_checkpoints["compressed-tensors"][0], random_prompts(3, 4, 30, seed=3), 8)


@pytest.mark.parametrize("block", [(4, 8), (3, 5), None])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_dequantizes_its_slice_with_the_scales_of_its_rows_and_columns(block, rank):
    """Blocks smaller than an expert and not aligned with the ranks' slices (3 x 5 over slices of 6 rows):
    each rank's stacked weights are its slice of every expert's whole dequantized weight."""
    scheme = Fp8Scheme(block=block)
    holder = nn.Module()
    holder.experts = Experts(3, 16, 12, TPGroup(rank, 2))
    attach_expert_scales(holder, scheme)
    gu, dn = holder.experts.gate_up_proj, holder.experts.down_proj
    want_gu, want_dn = _load_random_experts(holder.experts, scheme)
    dequantize_experts(holder, scheme)
    assert torch.equal(gu.weight, want_gu) and torch.equal(dn.weight, want_dn)
    assert not hasattr(gu, scheme.scale_name) and not hasattr(dn, scheme.scale_name)


def _load_random_experts(experts: Experts, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Loads random e4m3 experts quantized in the scheme's format, each as a checkpoint holds it whole, through
    the stacked projections' loaders (as the experts' rank); returns the float32 slices of their dequantized
    gate-up and down weights that the rank stands for."""
    gu, dn = experts.gate_up_proj, experts.down_proj
    num, hidden, local = gu.weight.shape[0], gu.weight.shape[2], gu.local
    inter, block, rank = local * gu.tp.size, scheme.block, gu.tp.rank
    g = torch.Generator().manual_seed(rank)
    gate, up = torch.randn(2, num, inter, hidden, generator=g)
    down = torch.randn(num, hidden, inter, generator=g)
    want_gu, want_dn = torch.empty(gu.weight.shape), torch.empty(dn.weight.shape)
    for e in range(num):
        for part, w in enumerate((gate[e], up[e])):
            q, scale = quantize_blocks(w, block) if block else quantize_channels(w, torch.float32)
            gu.weight_loader(gu.weight, q, (e, part))
            gu.weight_loader(getattr(gu, scheme.scale_name), scale, (e, part))
            full = dequantize_blocks(q, scale, block) if block else q.float() * scale
            want_gu[e, part * local : (part + 1) * local] = full[rank * local : (rank + 1) * local]
        q, scale = quantize_blocks(down[e], block) if block else quantize_channels(down[e], torch.float32)
        dn.weight_loader(dn.weight, q, (e, 0))
        dn.weight_loader(getattr(dn, scheme.scale_name), scale, (e, 0))
        full = dequantize_blocks(q, scale, block) if block else q.float() * scale
        want_dn[e] = full[:, rank * local : (rank + 1) * local]
    return want_gu, want_dn


def test_quantization_fp8_at_load_says_the_torch_loops_experts_stay_unquantized(moe_checkpoints, caplog):
    """`quantization="fp8"` where the torch loop runs the experts (here: the CPU without Triton's
    interpreter) quantizes the attention and dense linears; the experts stay in the model's dtype, and the
    engine says so rather than leaving it unsaid."""
    ref_path = moe_checkpoints["fp8"][1]
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        with checked_llm(ref_path, page_size=4, quantization="fp8") as llm:
            layer = llm.engine.model.model.layers[0]
            assert layer.self_attn.qkv_proj.weight.dtype == FP8
            assert layer.mlp.experts.gate_up_proj.weight.dtype == torch.float32
    assert any("leaves a mixture's experts in torch.float32" in r.getMessage() for r in caplog.records)


def _holder(experts: int = 2, hidden: int = 16, inter: int = 8, packed: dict | None = None) -> nn.Module:
    """A module whose experts sit where a model's do (model.layers.0.mlp.experts), with its `packed`."""
    holder, layer = nn.Module(), nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = Experts(experts, hidden, inter, TPGroup(0, 1))
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([layer])
    holder.packed = packed or {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    return holder


def test_a_per_tensor_scale_stands_for_every_row():
    holder = _holder()
    scheme = Fp8Scheme(ignore_style="compressed-tensors")
    attach_expert_scales(holder, scheme)
    gu = holder.model.layers[0].mlp.experts.gate_up_proj
    w = torch.randn(8, 16).to(FP8)
    for e in range(2):
        for part in (0, 1):
            gu.weight_loader(gu.weight, w, (e, part))
            gu.weight_loader(gu.weight_scale, torch.tensor([0.5]), (e, part))
    dequantize_experts(holder, scheme)
    assert torch.equal(gu.weight, (w.float() * 0.5).repeat(2, 2, 1))


@pytest.mark.parametrize(
    "scale,block,error",
    [
        (torch.ones(2, 1), (4, 8), r"weight_scale_inv is \[2, 1\], not \[2, 2\]"),  # the grid transposed
        (torch.ones(4), None, r"weight_scale is \[4\], not \[8\]"),
    ],
)
def test_scales_of_another_shape_are_refused_by_name(scale, block, error):
    from worker.loader import CheckpointError

    holder = _holder()
    scheme = Fp8Scheme(block=block)
    attach_expert_scales(holder, scheme)
    gu = holder.model.layers[0].mlp.experts.gate_up_proj
    with pytest.raises(CheckpointError, match=error):
        gu.weight_loader(getattr(gu, scheme.scale_name), scale, (0, 0))


def test_an_expert_weight_that_is_not_e4m3_beside_its_scales_is_refused():
    from worker.loader import CheckpointError

    holder = _holder()
    attach_expert_scales(holder, Fp8Scheme(block=(4, 8)))
    gu = holder.model.layers[0].mlp.experts.gate_up_proj
    with pytest.raises(CheckpointError, match="quantized weight is torch.bfloat16, not float8_e4m3fn"):
        gu.weight_loader(gu.weight, torch.zeros(8, 16, dtype=torch.bfloat16), (0, 0))


def test_the_ignore_list_is_read_with_the_checkpoints_names_of_every_expert():
    """Mixtral's names (block_sparse_moe, w1 / w3 / w2): every expert's gate and up left out leaves gate-up
    unquantized and down quantized; some of them is an error, as a fused dense layer's is."""
    from worker.models.mixtral import MixtralForCausalLM
    from worker.quant.scheme import QuantizationError

    names = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}" for e in range(2) for w in ("w1", "w3")]
    holder = _holder(packed=MixtralForCausalLM.packed)
    scheme = Fp8Scheme(ignore=tuple(names), ignore_style="compressed-tensors")
    assert attach_expert_scales(holder, scheme) == 1
    experts = holder.model.layers[0].mlp.experts
    assert not hasattr(experts.gate_up_proj, "weight_scale") and hasattr(experts.down_proj, "weight_scale")
    some = Fp8Scheme(ignore=tuple(names[:2]), ignore_style="compressed-tensors")
    with pytest.raises(QuantizationError, match="quantizes some of the experts in model.layers.0.mlp.experts"):
        attach_expert_scales(_holder(packed=MixtralForCausalLM.packed), some)


# ---- FP8 experts kept e4m3 where the fused kernels run them (under Triton's interpreter on the CPU)

# the fused expert kernels on CPU tensors, under Triton's interpreter (conftest sets TRITON_INTERPRET); the
# other Triton kernels off, so the FP8 linears compute as they do without it (over their dequantized weights)
MOE_INTERPRETED = Kernels(interpret_on_cpu=True, triton=False)


def _grouped_fp8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (e4m3, scales [E, N, K / group] (group 0: [E, N, 1]), the float32 weight they stand for)."""
    experts, rows, cols = w.shape
    width = group or cols
    groups = -(-cols // width)
    padded = F.pad(w.float(), (0, groups * width - cols)).view(experts, rows, groups, width)
    scale = (padded.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
    q = (padded / scale[..., None]).clamp(-448, 448).to(FP8).view(experts, rows, groups * width)[..., :cols]
    return q.contiguous(), scale, q.float() * scale.repeat_interleave(width, dim=-1)[..., :cols]


@pytest.mark.parametrize("per_row", [False, True, "down in a loop"])
@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (7, 4, 2, 40, 48)])
def test_fp8_expert_kernels_equal_the_torch_loop_over_the_dequantized_weights(
    tokens, num_experts, top_k, hidden, inter, group, per_row, monkeypatch
):
    """Both fused paths (grouped GEMMs, per-row kernels with the down kernel's at-once default and its loop)
    over e4m3 weights with a scale a row, or a scale for every 16 columns of a row (the last group partial
    where 16 does not divide the width): the torch loop's output over the weights they stand for, within
    float32's rounding."""
    pytest.importorskip("triton")
    from worker.layers.moe import fused

    if per_row == "down in a loop":
        monkeypatch.setattr(fused, "PER_ROW_DOWN_AT_ONCE", None)
        per_row = True
    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    q13, s13, w13 = _grouped_fp8(torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5, group)
    q2, s2, w2 = _grouped_fp8(torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5, group)
    weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    scales = ExpertScales(s13, s2, group, group)
    got = fused.fused_experts(x, q13, q2, weights, ids, per_row=per_row, scales=scales)
    torch.testing.assert_close(got, torch_experts(x, w13, w2, weights, ids))


def _w8a8_reference(x, w13, w2, weights, ids, group13, group2):
    """torch_experts with each GEMM's input rounded as the w8a8 GEMMs round it: x per token (and per scale
    group), each (token, choice) row of silu(gate) * up likewise before down."""
    from worker.quant.gemm import quantize_activations_torch

    x = _standing_for(*quantize_activations_torch(x, group13 or x.shape[1]), group13)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (x[t : t + 1] @ w13[e].T).chunk(2, dim=-1)
            h = F.silu(gate) * up
            h = _standing_for(*quantize_activations_torch(h, group2 or h.shape[1]), group2)
            out[t] += weights[t, k] * (h @ w2[e].T)[0]
    return out


@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter", [(24, 4, 2, 80, 96), (9, 2, 2, 96, 80)])
def test_w8a8_grouped_gemms_equal_the_torch_loop_over_quantized_activations(
    tokens, num_experts, top_k, hidden, inter, group
):
    """The grouped GEMMs with their activations quantized to e4m3 (their path on the GPU): x per
    token and h per (token, choice) row, per scale group where the weights' scales are grouped (the last
    group partial: 32 does not divide 80), multiplied e4m3 by e4m3, tokens of magnitudes 10^-2 to 10 and
    one of zeros among them: the torch loop over the dequantized weights and the activations rounded alike,
    within float32's rounding."""
    pytest.importorskip("triton")
    from worker.layers.moe import fused

    g = torch.Generator().manual_seed(tokens + hidden + group)
    x = torch.randn(tokens, hidden, generator=g) * 10 ** (3 * torch.rand(tokens, 1, generator=g) - 2)
    x[tokens // 2] = 0
    q13, s13, w13 = _grouped_fp8(torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5, group)
    q2, s2, w2 = _grouped_fp8(torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5, group)
    weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    scales = ExpertScales(s13, s2, group, group)
    got = fused.fused_experts(x, q13, q2, weights, ids, per_row=False, scales=scales, w8a8=True)
    want = _w8a8_reference(x, w13, w2, weights, ids, group, group)
    # float32's rounding at each token's own magnitude (the sums in another order)
    assert ((got - want).abs() <= 1e-5 * want.abs().amax(dim=1, keepdim=True)).all()
    assert got[tokens // 2].eq(0).all()
    # the activations' rounding is what separates it from the exact product, by FP8's step (2^-3 relative)
    exact = torch_experts(x, w13, w2, weights, ids)
    assert 0 < (got - exact).abs().max() <= 0.1 * exact.abs().max()


def test_w8a8_applies_to_the_grouped_gemms_over_fp8_experts_with_row_scales_on_a_gpu_with_fp8_tensor_cores(
    monkeypatch,
):
    from worker.layers.moe import fused

    scales = ExpertScales(torch.ones(2, 4, 1), torch.ones(2, 4, 1), 0, 0)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not fused.w8a8_applies(scales, 128, x, 64)  # not on the CPU: the torch loop is the reference there
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for _, height in fused.BLOCK_HEIGHTS:  # a decode batch's blocks and a prompt chunk's
        assert fused.w8a8_applies(scales, height, x, 64)
    assert not fused.w8a8_applies(None, 128, x, 64)  # bf16 experts
    # scales of groups of columns (a block-scaled checkpoint's): each K step's product weighed apart, slower
    assert not fused.w8a8_applies(ExpertScales(scales.gate_up, scales.down, 0, 32), 128, x, 64)
    assert not fused.w8a8_applies(ExpertScales(scales.gate_up, scales.down, 32, 0), 128, x, 64)
    assert not fused.w8a8_applies(scales, 128, x.float(), 64)  # a float32 model keeps exact activations
    assert not fused.w8a8_applies(scales, 128, x, 16)  # an FP8 product steps through K 32 columns at a time
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not fused.w8a8_applies(scales, 128, x, 64)  # no FP8 tensor cores


def test_fp8_per_row_kernels_route_as_the_torch_loop_does():
    """fused_moe at a few tokens, routing inside the per-row kernels, over FP8 experts."""
    pytest.importorskip("triton")
    from worker.layers.moe.fused import fused_moe, per_row_applies

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 32, generator=g)
    q13, s13, w13 = _grouped_fp8(torch.randn(64, 48, 32, generator=g) * 0.2, 16)
    q2, s2, w2 = _grouped_fp8(torch.randn(64, 32, 24, generator=g) * 0.2, 0)
    logits = torch.randn(3, 64, generator=g) * 2
    assert per_row_applies(3 * 4, 64)
    want = torch_experts(x, w13, w2, *select_experts(logits, 4, True))
    torch.testing.assert_close(fused_moe(x, logits, q13, q2, 4, True, scales=ExpertScales(s13, s2, 16, 0)), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp8_mixtures_experts_stay_e4m3_under_the_fused_kernels_and_its_tokens_are_transformers(
    moe_checkpoints, fmt, caplog
):
    """Where the fused kernels run the experts (here Triton's interpreter) they keep the checkpoint's e4m3
    weights, beside each row's scales: what they stand for is the dequantized reference's experts exactly,
    and greedy tokens equal transformers' over the reference."""
    pytest.importorskip("triton")
    path, ref_path = moe_checkpoints[fmt]
    prompts = random_prompts(3, 4, 30, seed=4)
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        with checked_llm(path, page_size=4, kernels=MOE_INTERPRETED) as llm, checked_llm(ref_path, page_size=4) as ref:
            _assert_e4m3_standing_for(llm, ref)
            outs = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert outs == hf_greedy(ref_path, prompts, 8, ignore_eos=True)
    assert not any("dequantized" in r.getMessage() for r in caplog.records)


def _assert_e4m3_standing_for(llm, ref) -> None:
    """Every expert of `llm` is e4m3 beside its rows' scales, standing for `ref`'s experts exactly."""
    for got, want in zip(_experts(llm), _experts(ref), strict=True):
        scales = got.scales()
        assert got.gate_up_proj.weight.dtype == FP8 and got.down_proj.weight.dtype == FP8
        assert torch.equal(_standing_for(got.gate_up_proj.weight, scales.gate_up), want.gate_up_proj.weight)
        assert torch.equal(_standing_for(got.down_proj.weight, scales.down), want.down_proj.weight)


def _standing_for(q: torch.Tensor, scales: torch.Tensor, group: int = 0) -> torch.Tensor:
    cols = q.shape[-1]
    width = group or cols
    return (q.float() * scales.repeat_interleave(width, dim=-1)[..., :cols]).to(torch.float32)


@pytest.mark.parametrize(
    "block,inter,groups",
    [
        ((3, 16), 64, {0: (16, 16), 1: (16, 16)}),
        (None, 64, {0: (0, 0), 1: (0, 0)}),
        ((3, 32), 96, {0: (32, 32), 1: (32, 16)}),  # rank 1's slice starts at column 48, inside a block
        ((2, 64), 96, {0: (0, 0), 1: (0, 16)}),  # rank 0's columns inside one block, rank 1's across two
        ((3, 32), 72, None),  # rank 1's slice starts at 36: no group of 16 or more starts there
        ((4, 8), 64, None),
        ((5, 24), 64, None),
        ((3, 48), 64, {0: (16, 0), 1: (16, 16)}),  # 48 columns a block: groups of 16 (a power of two dividing it)
    ],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_slice_of_e4m3_experts_with_its_rows_scales(block, inter, groups, rank):
    """keep_fp8 at tp 2: blocks 16 or 32 columns wide (rows in threes, not aligned with the ranks' slices)
    keep a scale for each group of a row's columns, a group as wide as a block, or narrower where a rank's
    slice of down starts inside a block (each block's scale repeated over its groups); per-channel scales
    one a row. Each rank's e4m3 weights times its scales are its slice of every expert's whole dequantized
    weight; blocks of 48 columns are grouped by 16. Where any rank's slice cannot be grouped so (no power of
    two of 16 or more divides both the block's width and where the slice starts: blocks 8 or 24 wide, a
    slice starting 4 columns into a block), every rank loads the experts into the model's dtype and
    dequantizes them instead."""
    scheme = Fp8Scheme(block=block)
    holder = nn.Module()
    holder.experts = Experts(3, 64, inter, TPGroup(rank, 2))
    attach_expert_scales(holder, scheme, keep_fp8=True)
    gu, dn = holder.experts.gate_up_proj, holder.experts.down_proj
    assert (gu.weight.dtype == FP8) == (groups is not None) == (dn.weight.dtype == FP8)
    want_gu, want_dn = _load_random_experts(holder.experts, scheme)
    assert keep_expert_scales(holder, scheme) == (2 if groups else 0)
    assert dequantize_experts(holder, scheme) == (0 if groups else 2)
    scales = holder.experts.scales()
    if groups is None:
        assert scales is None and torch.equal(gu.weight, want_gu) and torch.equal(dn.weight, want_dn)
        return
    assert (scales.gate_up_group, scales.down_group) == groups[rank]
    assert torch.equal(_standing_for(gu.weight, scales.gate_up, groups[rank][0]), want_gu)
    assert torch.equal(_standing_for(dn.weight, scales.down, groups[rank][1]), want_dn)
    assert not hasattr(gu, scheme.scale_name) and not hasattr(dn, scheme.scale_name)


def test_quantization_fp8_at_load_quantizes_a_mixtures_experts_a_scale_a_row(moe_checkpoints, monkeypatch):
    """`quantization="fp8"` where the fused kernels run the experts: they become e4m3 at one scale an output
    row, each row rounded as quantize_per_channel rounds a linear's, as each expert's tensor is read (never
    held unquantized: nothing is left to quantize once loaded); the engine serves with them."""
    pytest.importorskip("triton")
    from worker.quant import experts

    ref_path = moe_checkpoints["fp8"][1]
    prompts = random_prompts(2, 4, 30, seed=5)
    with checked_llm(ref_path, page_size=4) as ref:
        originals = [(b.gate_up_proj.weight.clone(), b.down_proj.weight.clone()) for b in _experts(ref)]

    def after_loading(module):
        raise AssertionError("an expert was quantized after it loaded")

    monkeypatch.setattr(experts, "_quantize_rows", after_loading)
    with checked_llm(ref_path, page_size=4, quantization="fp8", kernels=MOE_INTERPRETED) as llm:
        for block, (w13, w2) in zip(_experts(llm), originals, strict=True):
            scales = block.scales()
            assert (scales.gate_up_group, scales.down_group) == (0, 0)
            for q, s, w in (
                (block.gate_up_proj.weight, scales.gate_up, w13),
                (block.down_proj.weight, scales.down, w2),
            ):
                assert q.dtype == FP8 and s.shape == (*w.shape[:2], 1)
                for e in range(w.shape[0]):
                    want_q, want_s = quantize_per_channel(w[e])
                    assert torch.equal(q[e].float(), want_q.float()) and torch.equal(s[e, :, 0], want_s)
        assert all(len(o.token_ids) == 6 for o in llm.generate(prompts, greedy(6, ignore_eos=True)))


def test_an_fp8_mixture_quantized_at_load_at_tp2_equals_tp1(ray_cluster, moe_checkpoints):
    """Each row of down (split on its columns across the ranks) at the whole row's scale: tp 2 as tp 1."""
    pytest.importorskip("triton")
    assert_tp2_equals_tp1(
        moe_checkpoints["fp8"][1], random_prompts(2, 4, 20, seed=6), 6, quantization="fp8", kernels=MOE_INTERPRETED
    )


def test_an_fp8_mixture_keeping_its_experts_e4m3_at_tp2_equals_tp1(ray_cluster, moe_checkpoints):
    """The fused kernels over each rank's slice of the e4m3 experts and its rows' scales, read from a
    checkpoint by the loader (per-channel scales: see the tp 2 test above): tp 2 as tp 1."""
    pytest.importorskip("triton")
    path = moe_checkpoints["compressed-tensors"][0]
    assert_tp2_equals_tp1(path, random_prompts(2, 4, 20, seed=8), 6, kernels=MOE_INTERPRETED)


def test_quantization_at_load_leaves_out_the_experts_an_ignore_list_names():
    """Random weights drawn for an FP8 checkpoint's config are quantized as its ignore list says: a block
    whose gate and up (Mixtral's w1, w3) every expert leaves out stays in the model's dtype, both of its
    projections (the kernels take both e4m3 or neither); some experts of a projection is an error."""
    from worker.models.mixtral import MixtralForCausalLM
    from worker.quant.experts import quantize_experts
    from worker.quant.scheme import QuantizationError

    names = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}" for e in range(2) for w in ("w1", "w3")]
    holder = _holder(packed=MixtralForCausalLM.packed)
    assert quantize_experts(holder, Fp8Scheme(ignore=tuple(names), ignore_style="compressed-tensors")) == 0
    assert holder.model.layers[0].mlp.experts.scales() is None
    some = Fp8Scheme(ignore=tuple(names[:2]), ignore_style="compressed-tensors")
    with pytest.raises(QuantizationError, match="quantizes some of the experts"):
        quantize_experts(_holder(packed=MixtralForCausalLM.packed), some)
    holder = _holder(packed=MixtralForCausalLM.packed)
    assert quantize_experts(holder, Fp8Scheme()) == 2 and holder.model.layers[0].mlp.experts.scales() is not None


@pytest.mark.parametrize("block,kept", [((3, 16), True), ((5, 24), False)])
def test_experts_made_e4m3_stay_so_where_kept_and_take_the_models_dtype_where_not(block, kept):
    """An FP8 checkpoint's experts are made e4m3 while the model is built (never held in bf16 first): where
    attach_expert_scales keeps them, the very weights made; where not (blocks the kernels cannot group), new
    weights in the model's dtype for the checkpoint's values to load into."""
    from worker.layers.moe.weights import experts_made_in

    with experts_made_in(FP8):
        experts = Experts(3, 64, 64, TPGroup(0, 2))
    holder = nn.Module()
    holder.experts = experts
    made = experts.gate_up_proj.weight
    assert made.dtype == FP8 and experts.down_proj.weight.dtype == FP8
    attach_expert_scales(holder, Fp8Scheme(block=block), keep_fp8=True, dtype=torch.bfloat16)
    assert (experts.gate_up_proj.weight is made) == kept
    assert experts.down_proj.weight.dtype == (FP8 if kept else torch.bfloat16)
    with experts_made_in(None):
        assert Experts(3, 64, 64, TPGroup(0, 1)).gate_up_proj.weight.dtype == torch.get_default_dtype()
