"""A mixture of experts' FP8 checkpoint in both published formats (transformers' block-scaled `fp8`, the
format of Qwen3-MoE's FP8 releases; compressed-tensors' per-channel FP8): its experts' e4m3 weights and
scales are read into the stacked expert parameters and dequantized there once loaded, each rank its slice;
its other linears stay FP8. Against transformers over the same weights dequantized to float32 (the tiny
checkpoints of tests/fp8_checkpoints.py): the stacked experts equal the reference's exactly, so greedy
tokens agree exactly on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from fixtures import hf_greedy
from fp8_checkpoints import FP8, dequantize_blocks, quantize_blocks, quantize_channels, write_fp8_checkpoint
from helpers import assert_tp2_equals_tp1, checked_llm, greedy
from tiny_checkpoints import build_checkpoint, random_prompts
from torch import nn

from worker.layers.moe.weights import Experts
from worker.parallel import TPGroup
from worker.quant.experts import attach_expert_scales, dequantize_experts
from worker.quant.scheme import Fp8Scheme

FORMATS = ["fp8", "compressed-tensors"]


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
    assert any("experts are dequantized to torch.float32 at load" in r.getMessage() for r in caplog.records)


def test_an_fp8_mixture_at_tp2_equals_tp1(ray_cluster, moe_checkpoints):
    # per-channel scales: the tiny model's dense layers are narrower than a 128-wide block, which a
    # row-parallel shard may not start inside (the block format at tp 2 is refused for them, by name)
    assert_tp2_equals_tp1(moe_checkpoints["compressed-tensors"][0], random_prompts(3, 4, 30, seed=3), 8)


@pytest.mark.parametrize("block", [(4, 8), (3, 5), None])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_dequantizes_its_slice_with_the_scales_of_its_rows_and_columns(block, rank):
    """Blocks smaller than an expert and not aligned with the ranks' slices (3 x 5 over slices of 6 rows):
    each rank's stacked weights are its slice of every expert's whole dequantized weight."""
    experts, hidden, inter = 3, 16, 12
    g = torch.Generator().manual_seed(rank)
    gate, up = torch.randn(2, experts, inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    scheme = Fp8Scheme(block=block)
    holder = nn.Module()
    holder.experts = Experts(experts, hidden, inter, TPGroup(rank, 2))
    attach_expert_scales(holder, scheme)
    gu, dn = holder.experts.gate_up_proj, holder.experts.down_proj
    want_gu, want_dn = torch.empty_like(gu.weight), torch.empty_like(dn.weight)
    local = inter // 2
    for e in range(experts):
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
    dequantize_experts(holder, scheme)
    assert torch.equal(gu.weight, want_gu) and torch.equal(dn.weight, want_dn)
    assert not hasattr(gu, scheme.scale_name) and not hasattr(dn, scheme.scale_name)


def test_quantization_fp8_at_load_says_a_mixtures_experts_stay_unquantized(moe_checkpoints, caplog):
    """`quantization="fp8"` quantizes the attention and dense linears; the experts stay in the model's
    dtype, and the engine says so rather than leaving it unsaid."""
    ref_path = moe_checkpoints["fp8"][1]
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        with checked_llm(ref_path, page_size=4, quantization="fp8") as llm:
            layer = llm.engine.model.model.layers[0]
            assert layer.self_attn.qkv_proj.weight.dtype == FP8
            assert layer.mlp.experts.gate_up_proj.weight.dtype == torch.float32
    assert any("a mixture's experts stay in torch.float32" in r.getMessage() for r in caplog.records)


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
