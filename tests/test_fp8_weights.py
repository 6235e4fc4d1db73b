"""FP8 weights on the CPU: checkpoints in the published formats (transformers' block-scaled `fp8`,
compressed-tensors' per-channel FP8, and the static ones: a scale a weight and calibrated activation scales,
compressed-tensors' and AutoFP8's), tiny ones made here from a tiny float32 model, against transformers
over the same weights dequantized to float32; their scales sharded with their weights across tp ranks;
`quantization="fp8"` at load; clear errors for what is not served; the Triton FP8 kernels under the
interpreter against the torch path.

Tolerance: on the CPU a layer dequantizes its e4m3 weight with its scales in float32, to exactly the
reference's float32 weight, so logits differ only by float32's order of additions (LOGIT_TOL of their
norm) and greedy tokens agree exactly. (The GPU's activation quantization: tests/test_fp8_gpu.py.)"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from fp8_checkpoints import (
    UNQUANTIZED,
    dequantize_blocks,
    quantization_config,
    quantize_blocks,
    quantize_channels,
    write_fp8_checkpoint,
    write_rounded_projections,
)
from helpers import assert_tp2_equals_tp1, checked_llm, encode_all, gated_calls, greedy
from tiny_checkpoints import build_qwen3_hd128
from transformers import AutoConfig, AutoModelForCausalLM

from cluster import LLM
from worker import gemv, skinny_gemm
from worker.kernels import Kernels
from worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.loader import CheckpointError, LazyTensor
from worker.parallel import TPGroup
from worker.quant import gemm
from worker.quant.fp8 import FP8, Fp8Weights, dequantize, quantize_per_channel
from worker.quant.scheme import Fp8Scheme, QuantizationError

FORMATS = ["fp8", "compressed-tensors", "compressed-tensors-block", "fp8-static", "compressed-tensors-static"]
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def hd128(tmp_path_factory):
    """A tiny Qwen3 whose widths are whole 128-blocks at tp 1 and 2 (hidden 256, 4 heads of 128)."""
    return build_qwen3_hd128(tmp_path_factory.mktemp("qwen3_hd128"))


@pytest.fixture(scope="module")
def checkpoints(hd128, tmp_path_factory):
    """Each format's (FP8 folder, dequantized reference folder)."""
    out = tmp_path_factory.mktemp("fp8_checkpoints")
    return {fmt: write_fp8_checkpoint(hd128, out, fmt) for fmt in FORMATS}


def _prompts(n: int = 6) -> list[list[int]]:
    from tiny_checkpoints import random_prompts

    return random_prompts(n, 4, 40, seed=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_keeps_e4m3_weights_and_leaves_the_ignored_layers_unquantized(checkpoints, fmt):
    with checked_llm(checkpoints[fmt][0], page_size=4) as llm:
        layers = llm.engine.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == FP8
        assert layers[0].mlp.down_proj.weight.dtype == FP8 and layers[0].mlp.down_proj.quant is not None
        assert UNQUANTIZED == "model.layers.1.mlp.down_proj"
        assert layers[1].mlp.down_proj.quant is None and layers[1].mlp.down_proj.weight.dtype == torch.float32
        assert llm.engine.model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_logits_are_transformers_over_the_dequantized_weights(checkpoints, fmt):
    path, ref_path = checkpoints[fmt]
    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    with checked_llm(path, page_size=4) as llm:
        rows = []
        compute_logits = llm.engine.model.compute_logits
        llm.engine.model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
        for p in prompts:
            llm.generate([p], greedy(1))
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    got = torch.stack([r[-1] for r in rows])
    assert float((got - want).norm() / want.norm()) < LOGIT_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_greedy_tokens_equal_the_dequantized_references(checkpoints, fmt):
    path, ref_path = checkpoints[fmt]
    prompts = _prompts()
    with checked_llm(path, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    assert got == hf_greedy(ref_path, prompts, 16, ignore_eos=True)


def test_fp8_batch_1_decode_through_the_triton_gemvs_equals_the_dequantized_reference(checkpoints, monkeypatch):
    """One prompt under Triton's interpreter (slow: block scales only; the per-channel GEMV's unit tests in
    tests/test_row_fusion.py): every linear's FP8 GEMV reads the e4m3 weight and its scales itself,
    gate-up's with SiLU-and-multiply in its epilogue (down's takes no SiLU), every norm on its own (inside
    an FP8 GEMV it was measured slower)."""
    pytest.importorskip("triton")
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")
    from worker.kernels import Kernels

    path, ref_path = checkpoints["fp8"]
    calls = gated_calls(monkeypatch, gemm, "fp8_gemv")
    norm_calls = gated_calls(monkeypatch, gemv, "norm_linear")
    prompts = _prompts(1)
    with checked_llm(path, page_size=4, kernels=Kernels(interpret_on_cpu=True)) as llm:
        got = [llm.generate([p], greedy(4, ignore_eos=True))[0].token_ids for p in prompts]
    assert got == hf_greedy(ref_path, prompts, 4, ignore_eos=True)
    assert True in calls and False in calls
    assert not norm_calls


# block-scaled weights end to end at tp=2; both formats' shards and scales are checked in process below
@pytest.mark.parametrize("fmt", ["fp8"])
def test_fp8_checkpoint_at_tp2_equals_tp1(ray_cluster, checkpoints, fmt):
    assert_tp2_equals_tp1(checkpoints[fmt][0], _prompts(4), 12)


def test_quantization_fp8_at_load_at_tp2_equals_tp1(ray_cluster, hd128):
    # o and down are row-parallel: a rank holds half of each output row, and scales it by the whole row's
    # largest magnitude, as tp=1 does, so both quantize every weight alike
    assert_tp2_equals_tp1(hd128, _prompts(4), 12, quantization="fp8")


def test_row_parallel_shards_quantized_at_load_take_the_whole_rows_scales():
    torch.manual_seed(0)
    full = torch.randn(48, 128)
    whole_q, whole_s = quantize_per_channel(full)
    shards = full.chunk(2, dim=1)
    # the largest magnitude of each row over both ranks' columns, as max_over_ranks gives it
    row_max = torch.stack([p.abs().amax(dim=1) for p in shards]).amax(dim=0)
    for rank, part in enumerate(shards):
        q, s = quantize_per_channel(part, lambda amax, m=row_max: torch.maximum(amax, m))
        assert torch.equal(s, whole_s)
        assert torch.equal(q.float(), whole_q.float().chunk(2, dim=1)[rank])


def test_quantization_fp8_at_load_is_the_model_over_its_per_channel_e4m3_weights(qwen3_path, tmp_path):
    # the reference: the same checkpoint with every projection rounded per output channel (the test's own
    # quantizer, float32 scales) and dequantized, run by transformers
    ref = write_rounded_projections(qwen3_path, tmp_path / "ref")
    with checked_llm(qwen3_path, page_size=4, quantization="fp8") as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
        assert linears and all(m.weight.dtype == FP8 for m in linears)
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        got = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 16, ignore_eos=True)


def _linears_and_norms(model) -> dict[str, torch.Tensor]:
    """Every linear's weight (its bytes: e4m3 compares bit for bit) and scales, and every norm's weight."""
    from worker.layers.norm import RMSNorm

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            out[f"{name}.weight"] = m.weight.data.view(torch.uint8) if m.weight.dtype == FP8 else m.weight.data
            out[f"{name}.weight_scale"] = m.weight_scale
        elif isinstance(m, RMSNorm):
            out[f"{name}.weight"] = m.weight.data
    return out


@pytest.fixture(scope="module")
def norms_drawn(qwen3_path, tmp_path_factory):
    """The tiny Qwen3 with norm weights drawn around one (its own are ones, which fold into nothing)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("norms_drawn") / "qwen3"
    shutil.copytree(qwen3_path, out)
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.2 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("folded", [True, False])
def test_quantization_fp8_quantizes_each_linear_as_it_loads_as_the_loaded_model_would_be(norms_drawn, folded):
    """quantization fp8 over an unquantized checkpoint makes the linears e4m3 and quantizes each one once its
    parts (and the norm folded into it, which the checkpoint holds after gate and up) are read: the weights,
    scales and norms equal, bit for bit, the unquantized model's loaded whole and then quantized
    (quantize_linears), folded or not; no linear is left holding its unquantized rows."""
    from dataclasses import replace

    from worker.quant.loading import QuantizingLoad
    from worker.quant.prepare import quantize_linears

    fp8_norms = "folded" if folded else "apart"
    with checked_llm(norms_drawn, page_size=4, quantization="fp8", kernels=Kernels(fp8_norms=fp8_norms)) as llm:
        model = llm.engine.model
        assert not any(isinstance(getattr(m, "quant", None), QuantizingLoad) for m in model.modules())
        got = _linears_and_norms(model)
        assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8
        assert model.model.layers[0].post_attention_layernorm.folded == folded
    with checked_llm(norms_drawn, page_size=4) as llm:
        model = llm.engine.model
        scheme = Fp8Scheme(prequantized=False)
        assert quantize_linears(model, replace(scheme, block=None), fold_norms=folded) > 0
        want = _linears_and_norms(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _norms_in_a_file_of_their_own(src, out):
    """src's checkpoint split in two files, every norm in the second (an index names them): a linear's
    folded norm comes after all the linears."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    norms = {n: t for n, t in tensors.items() if n.endswith("norm.weight")}
    rest = {n: t for n, t in tensors.items() if n not in norms}
    save_file(rest, str(out / "model-00001-of-00002.safetensors"))
    save_file(norms, str(out / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in rest}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in norms})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("layout", ["as saved", "norms in a file of their own"])
def test_quantization_fp8_holds_a_linear_or_two_unquantized_at_a_time_while_loading(
    norms_drawn, tmp_path, monkeypatch, layout
):
    """While an unquantized checkpoint loads with quantization fp8, at most two linears hold their
    unquantized rows at once (the norms folded into linears load first, wherever the checkpoint keeps them),
    and every such buffer is freed by the end; the weights are still the loaded model's quantized."""
    import gc
    import weakref

    from worker.quant import loading

    path = norms_drawn if layout == "as saved" else _norms_in_a_file_of_their_own(norms_drawn, tmp_path / "split")
    buffers, most = [], [0]
    held = loading.QuantizingLoad._held

    def tracking(self, layer):  # the buffers alive as one more is made or filled (freed ones die at once)
        fresh = self.rows is None
        rows = held(self, layer)
        if fresh:
            buffers.append(weakref.ref(rows))
        most[0] = max(most[0], sum(b() is not None for b in buffers))
        return rows

    monkeypatch.setattr(loading.QuantizingLoad, "_held", tracking)
    with checked_llm(path, page_size=4, quantization="fp8") as llm:
        gc.collect()
        assert len(buffers) >= 8 and all(b() is None for b in buffers)
        got = _linears_and_norms(llm.engine.model)
    assert 1 <= most[0] <= 2
    with checked_llm(norms_drawn, page_size=4, quantization="fp8") as llm:
        want = _linears_and_norms(llm.engine.model)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_linear_left_waiting_for_a_part_or_given_one_twice_is_an_error_naming_it():
    from worker.layers.linear import linears_made_in
    from worker.quant.loading import check_quantized_while_loading, quantize_linears_while_loading

    model = torch.nn.Module()
    with linears_made_in(FP8):
        model.gate_up_proj = ColumnParallelLinear(16, [8, 8], bias=False, tp=TPGroup(0, 1))
    assert quantize_linears_while_loading(model, Fp8Scheme(prequantized=False), torch.float32, fold_norms=False) == 1
    gate = torch.randn(8, 16)
    model.gate_up_proj.weight_loader(model.gate_up_proj.weight, gate, 0)
    with pytest.raises(CheckpointError, match="part of gate_up_proj twice"):
        model.gate_up_proj.weight_loader(model.gate_up_proj.weight, gate, 0)
    with pytest.raises(CheckpointError, match="lacks parts of gate_up_proj"):
        check_quantized_while_loading(model)
    model.gate_up_proj.weight_loader(model.gate_up_proj.weight, torch.randn(8, 16), 1)
    check_quantized_while_loading(model)
    assert model.gate_up_proj.weight.dtype == FP8 and isinstance(model.gate_up_proj.quant, Fp8Weights)


def test_quantization_fp8_over_a_checkpoint_missing_a_linears_part_is_an_error_naming_it(qwen3_path, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_path, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.0.self_attn.qkv_proj"):
        LLM(str(broken), page_size=4, quantization="fp8")


def test_quantization_fp8_quantizes_random_dummy_weights(qwen3_path):
    with checked_llm(qwen3_path, page_size=4, quantization="fp8", load_format="dummy") as llm:
        assert llm.engine.model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8
        outs = llm.generate(PROMPT_TEXTS[:3], greedy(8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8] * 3


def _with_quantization_config(src, tmp_path, qc: dict):
    import shutil

    out = tmp_path / "q"
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_checkpoint_quantized_by_another_method_is_an_error_naming_it(qwen3_path, tmp_path):
    path = _with_quantization_config(qwen3_path, tmp_path, {"quant_method": "awq", "bits": 4})
    with pytest.raises(QuantizationError, match="'awq'"):
        LLM(str(path))


def test_compressed_tensors_int8_weights_are_an_error(qwen3_path, tmp_path):
    from fp8_checkpoints import quantization_config

    qc = quantization_config("compressed-tensors")
    qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=8)
    with pytest.raises(QuantizationError, match="int 8-bit"):
        LLM(str(_with_quantization_config(qwen3_path, tmp_path, qc)))


@pytest.mark.parametrize("fmt", ["fp8-static", "compressed-tensors-static"])
def test_static_activation_scales_are_not_read_and_the_log_says_so(checkpoints, fmt, caplog):
    from worker.quant.scheme import scheme_of

    path = checkpoints[fmt][0]
    assert scheme_of(AutoConfig.from_pretrained(path), None).static_activations
    with caplog.at_level(logging.WARNING, logger="worker.engine"), checked_llm(path, page_size=4) as llm:
        layer = llm.engine.model.model.layers[0]
        assert not any("input_scale" in name for name, _ in llm.engine.model.named_parameters())
        assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert any("input_scale" in r.getMessage() and "per token" in r.getMessage() for r in caplog.records)


def test_static_activation_scales_of_another_granularity_are_an_error(qwen3_path, tmp_path):
    from fp8_checkpoints import quantization_config

    qc = quantization_config("compressed-tensors-static")
    qc["config_groups"]["group_0"]["input_activations"]["strategy"] = "channel"
    with pytest.raises(QuantizationError, match="static per-tensor"):
        LLM(str(_with_quantization_config(qwen3_path, tmp_path, qc)))


@pytest.mark.parametrize(
    "change,named",
    [
        (lambda g: g["input_activations"].update(group_size=64), "group_size=64"),
        (lambda g: g["weights"].pop("block_structure"), "block_structure of two sizes"),
        (lambda g: g["input_activations"].update(strategy="tensor", dynamic=False), "static per-tensor ones over"),
    ],
    ids=["groups-narrower-than-a-block", "no-block-structure", "static-activations-over-blocks"],
)
def test_block_scales_with_activations_the_gemm_does_not_quantize_so_are_an_error(qwen3_path, tmp_path, change, named):
    from fp8_checkpoints import quantization_config

    qc = quantization_config("compressed-tensors-block")
    change(qc["config_groups"]["group_0"])
    with pytest.raises(QuantizationError, match=re.escape(named)):
        LLM(str(_with_quantization_config(qwen3_path, tmp_path, qc)))


def test_static_activations_over_transformers_block_scales_are_an_error(qwen3_path, tmp_path):
    from fp8_checkpoints import quantization_config

    qc = {**quantization_config("fp8"), "activation_scheme": "static"}
    with pytest.raises(QuantizationError, match="'static' over block scales"):
        LLM(str(_with_quantization_config(qwen3_path, tmp_path, qc)))


def test_an_unknown_fp8_activation_scheme_is_an_error(qwen3_path, tmp_path):
    from fp8_checkpoints import quantization_config

    qc = {**quantization_config("fp8"), "activation_scheme": "calibrated"}
    with pytest.raises(QuantizationError, match="'calibrated'"):
        LLM(str(_with_quantization_config(qwen3_path, tmp_path, qc)))


def test_an_unknown_quantization_setting_is_a_config_error(qwen3_path):
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="quantization"):
        LLM(str(qwen3_path), quantization="int4")


def test_an_unquantized_weight_where_fp8_is_expected_is_an_error(hd128, tmp_path):
    # a float32 checkpoint that claims to be FP8
    path = _with_quantization_config(hd128, tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(CheckpointError, match="float8_e4m3fn"):
        LLM(str(path))


# -- scales shard with their weights ---------------------------------------------------------------------


def _lazy(t: torch.Tensor):
    """A checkpoint tensor as the loader hands it over (read in slices)."""

    class Slice:
        def get_shape(self):
            return list(t.shape)

        def __getitem__(self, index):
            return t[index]

    return LazyTensor(Slice())


def _local_weight(layer) -> torch.Tensor:
    return dequantize(layer.weight, layer.quant.scale_of(layer), layer.quant.block)


@pytest.mark.parametrize("block", [None, (64, 32)])
def test_each_rank_holds_its_rows_of_fused_parts_and_their_scales(block):
    # gate/up of 96 rows each at tp 2: a rank's 48 rows cut a 64-row scale block, which both ranks share
    torch.manual_seed(0)
    parts = [torch.randn(96, 64), torch.randn(96, 64)]
    scheme = Fp8Scheme(block=block)
    full = []
    for rank in range(2):
        layer = ColumnParallelLinear(64, [96, 96], bias=False, tp=TPGroup(rank, 2))
        Fp8Weights.attach(layer, scheme)
        for shard, w in enumerate(parts):
            q, s = quantize_blocks(w, block) if block else quantize_channels(w, torch.float32)
            layer.weight_loader(layer.weight, _lazy(q), shard)
            layer.weight_loader(getattr(layer, scheme.scale_name), _lazy(s), shard)
            want = dequantize_blocks(q, s, block) if block else q.float() * s
            full.append((rank, shard, want))
        local = _local_weight(layer)
        for r, shard, want in full:
            if r == rank:
                assert torch.equal(local[shard * 48 : (shard + 1) * 48], want[rank * 48 : (rank + 1) * 48])


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_each_rank_holds_its_columns_of_a_row_parallel_weight_and_their_scales(block):
    torch.manual_seed(1)
    w = torch.randn(48, 128)
    q, s = quantize_blocks(w, block) if block else quantize_channels(w, torch.float32)
    want = dequantize_blocks(q, s, block) if block else q.float() * s
    scheme = Fp8Scheme(block=block)
    for rank in range(2):
        layer = RowParallelLinear(128, 48, bias=False, tp=TPGroup(rank, 2))
        Fp8Weights.attach(layer, scheme)
        layer.weight_loader(layer.weight, _lazy(q))
        layer.weight_loader(getattr(layer, scheme.scale_name), _lazy(s))
        assert torch.equal(_local_weight(layer), want[:, rank * 64 : (rank + 1) * 64])


def test_replicated_kv_heads_take_their_heads_scales():
    # 1 KV head at tp 2: both ranks hold it, each its own query head
    torch.manual_seed(2)
    q_w, k_w, v_w = torch.randn(32, 16), torch.randn(16, 16), torch.randn(16, 16)
    for rank in range(2):
        layer = QKVParallelLinear(16, 16, 2, 1, bias=False, tp=TPGroup(rank, 2))
        Fp8Weights.attach(layer, Fp8Scheme())
        wants = []
        for shard, w in enumerate((q_w, k_w, v_w)):
            q, s = quantize_channels(w, torch.float32)
            layer.weight_loader(layer.weight, _lazy(q), shard)
            layer.weight_loader(layer.weight_scale, _lazy(s), shard)
            wants.append(q.float() * s)
        want = torch.cat([wants[0][rank * 16 : (rank + 1) * 16], wants[1], wants[2]])
        assert torch.equal(_local_weight(layer), want)


def test_a_row_parallel_shard_inside_a_scale_block_is_an_error():
    layer = RowParallelLinear(128, 16, bias=False, tp=TPGroup(1, 2))
    Fp8Weights.attach(layer, Fp8Scheme(block=(128, 128)))
    q, s = quantize_blocks(torch.randn(16, 128), (128, 128))
    with pytest.raises(CheckpointError, match="scale block"):
        layer.weight_loader(layer.weight_scale_inv, _lazy(s))


# -- the Triton kernels under the interpreter --------------------------------------------------------------


@pytest.fixture
def needs_triton():
    pytest.importorskip("triton")
    if gemm._fp8_kernels() is None:
        pytest.skip("no Triton")


def _weights(n: int, k: int, block):
    torch.manual_seed(n * k)
    w = torch.randn(n, k) * 0.05
    if block is None:
        q, s = quantize_channels(w, torch.float32)
        return q, s.view(-1)
    q, s = quantize_blocks(w, block)
    return q, s.repeat_interleave(block[0], dim=0)[:n].contiguous()


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_the_fp8_gemv_is_float32_over_the_dequantized_weight(needs_triton, block):
    q, s = _weights(40, 96, block)
    x = torch.randn(1, 96)
    got = gemm.fp8_gemv(x, q, s, block, block_k=64)
    torch.testing.assert_close(got, x @ dequantize(q, s, block).T, rtol=1e-5, atol=1e-5)


def test_the_block_scaled_gemm_is_float32_over_the_rounded_activations_and_weights(needs_triton):
    # 40 x 96 weight in 32-blocks, 5 rows: partial tiles everywhere
    q, s = _weights(40, 96, (32, 32))
    x = torch.randn(5, 96)
    got = gemm.block_scaled_mm(x, q, s, 32)
    xq, xs = gemm.quantize_activations_torch(x, 32)
    want = (xq.float() * xs.repeat_interleave(32, dim=1)) @ dequantize(q, s, (32, 32)).T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [5, 150])
def test_fp16_rows_over_per_channel_fp8_weights_take_the_triton_gemm_not_a_widened_weight(
    needs_triton, monkeypatch, rows
):
    """fp16 activations (which cuBLASLt's rowwise-scaled GEMM cannot write) at a decode batch and at a
    prompt chunk's rows (past SKINNY_MAX_ROWS) multiply through the Triton GEMM in fp16, the weight never
    dequantized: the float32 product of the rounded activations and weights, to fp16's rounding."""
    q, s = _weights(40, 96, None)
    x = (torch.randn(rows, 96) * 3).half()

    def widened(*args):
        raise AssertionError("the FP8 weight was dequantized for an fp16 product")

    monkeypatch.setattr(gemm, "dequantized_linear", widened)
    got = gemm.fp8_linear(x, q, s, None, kernels=Kernels(interpret_on_cpu=True))
    assert got.dtype == torch.float16
    xq, xs = gemm.quantize_activations_torch(x, 96)
    want = (xq.float() * xs) @ dequantize(q, s, None).T
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("rows,k", [(21, 160), (21, 150), (150, 160)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("scales", ["row", "block", "none"])
def test_the_triton_gemm_split_over_k_is_float32_over_its_operands(needs_triton, split_k, scales, rows, k):
    """skinny_gemm.matmul, 21 rows (150: past SKINNY_MAX_ROWS, its grid over M first) of a 40 x K weight in
    16 x 16 tiles (partial tiles; five K steps over three splits, the last shorter; at K = 150 a partial last
    step): over e4m3 operands scaled per token and channel or per 32-column group, and over unscaled ones
    (float32 here; bf16 on the GPU, tests/test_fp8_gpu.py). The products in float32 (to 1e-6 of the
    largest), every split's count reset for the next launch, the same sum twice."""
    g = torch.Generator().manual_seed(split_k)
    dtype = torch.float32 if scales == "none" else FP8
    a, b = (torch.randn(rows, k, generator=g) * 40).to(dtype), (torch.randn(40, k, generator=g) * 40).to(dtype)
    group_k = 32 if scales == "block" else None
    groups = -(-k // 32) if scales == "block" else 1
    a_s, b_s = torch.rand(rows, groups, generator=g) + 0.5, torch.rand(40, groups, generator=g) + 0.5
    if scales == "none":
        a_s, b_s = torch.ones(rows, 1), torch.ones(40, 1)
    width = 32 if scales == "block" else k
    a_w, b_w = (t.repeat_interleave(width, dim=1)[:, :k] for t in (a_s, b_s))
    want = (a.float() * a_w) @ (b.float() * b_w).T
    tile = skinny_gemm.MmTile(16, 16, 32, split_k)
    args = () if scales == "none" else (a_s, b_s if group_k else b_s.view(-1), group_k)
    got = skinny_gemm.matmul(a, b, torch.float32, *args, tile=tile)
    # float32's order of additions (and per-channel scales applied after the sum), against the largest
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(skinny_gemm.matmul(a, b, torch.float32, *args, tile=tile), got)
    assert not skinny_gemm._split_counts(torch.device("cpu")).any()


def test_full_decode_batches_of_narrow_fp8_layers_take_the_triton_gemm_in_64_row_tiles():
    """Past SKINNY_MAX_ROWS up to FULL_BATCH_ROWS, an FP8 layer of at most NARROW_N output columns with
    per-channel scales (Qwen3-8B's o and down) multiplies in the Triton GEMM at FULL_BATCH_TILE; wider
    layers do not pay there (cuBLASLt), and block-scaled products, bf16 and more rows keep the 128-row tile."""
    fp8_weight = {n: torch.empty(n, 4096, dtype=FP8) for n in (4096, 6144, 24576)}
    for rows in (129, 200, 256):
        assert skinny_gemm.pays(rows, fp8_weight[4096])
        assert not skinny_gemm.pays(rows, fp8_weight[6144]) and not skinny_gemm.pays(rows, fp8_weight[24576])
        for k in (4096, 12288):
            assert skinny_gemm.mm_tile(rows, 4096, k, 1) == skinny_gemm.FULL_BATCH_TILE
        assert skinny_gemm.mm_tile(rows, 4096, 4096, 1, group_k=128).block_m == 128  # block-scaled: unchanged
        assert skinny_gemm.mm_tile(rows, 4096, 4096, 2).block_m == 128  # bf16: unchanged
    assert not skinny_gemm.pays(257, fp8_weight[4096])
    assert skinny_gemm.mm_tile(257, 4096, 4096, 1).block_m == 128
    assert skinny_gemm.mm_tile(128, 4096, 4096, 1) == skinny_gemm.MmTile(128, 32, 256, 1, 4, 4)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("k", [64, 1000, 2500])  # within one block; a partial block; three blocks
def test_the_norm_with_the_fp8_quantization_inside_is_the_norm_then_the_quantization(needs_triton, with_residual, k):
    """An FP8 linear's input quantized inside the residual norm (worker/quant/fused_quant.py): the new
    residual is x + residual, updated in place, and the scale each row's largest normed magnitude over
    448. In float32, and the e4m3 values unchecked: the interpreter truncates to bfloat16 and converts to
    e4m3 wrongly, where a GPU rounds (tests/test_fp8_gpu.py checks those there)."""
    from worker.quant import fused_quant

    g = torch.Generator().manual_seed(k)
    x, residual = (torch.randn(5, k, generator=g) * 2 for _ in range(2))
    weight = 1 + 0.3 * torch.randn(k, generator=g)
    s = x + residual if with_residual else x
    normed = s * weight * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    _, want_s = gemm.quantize_activations_torch(normed, k)
    xq, xs, new_residual = fused_quant.norm_quant(x, residual if with_residual else None, weight, 1e-6)
    torch.testing.assert_close(new_residual, s, rtol=0, atol=0)
    assert new_residual.data_ptr() == (residual if with_residual else x).data_ptr()  # in place, as the fused norm
    torch.testing.assert_close(xs, want_s, rtol=1e-6, atol=0)
    assert xq.dtype == FP8 and xq.shape == x.shape


@pytest.mark.parametrize("inter", [48, 1000, 2100])
def test_silu_with_the_fp8_quantization_inside_is_silu_then_the_quantization(needs_triton, inter):
    from worker.quant import fused_quant

    gate_up = torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    _, want_s = gemm.quantize_activations_torch(h, inter)
    xq, xs = fused_quant.silu_quant(gate_up)
    torch.testing.assert_close(xs, want_s, rtol=1e-6, atol=0)
    assert xq.dtype == FP8 and xq.shape == h.shape


def test_activations_round_per_token_group_to_448_at_their_largest():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = gemm.quantize_activations_torch(x, 2)
    assert s[0].tolist() == pytest.approx([2 / 448, 4 / 448])
    assert q[0].float().abs().amax().item() == 448 and torch.equal(q[1].float(), torch.zeros(4))


def test_the_real_model_quantized_at_load_answers_its_factual_questions(smollm2_path):
    from test_real_model import QUESTIONS, chat_ids

    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_path))
    with checked_llm(smollm2_path, page_size=16, num_pages=256, quantization="fp8") as llm:
        assert llm.engine.model.model.layers[0].mlp.down_proj.weight.dtype == FP8
        # each answer names its word within its first dozen tokens (a step dequantizes every weight on the CPU)
        outs = llm.generate([chat_ids(tokenizer, q) for q in QUESTIONS], greedy(12))
    for (question, word), out in zip(QUESTIONS.items(), outs):
        assert word in tokenizer.decode(out.token_ids), question


@pytest.mark.parametrize("rows", [0, 3])
def test_activations_quantize_per_token_and_group_for_any_row_count(rows):
    """quantize_activations (the CPU's path, torch) over rows of 40 columns in groups of 16 (the last partial):
    e4m3 values that times their group's scale give back the row within e4m3's step, each group's largest
    magnitude at 448; no rows give empty tensors of those shapes."""
    from worker.quant.gemm import quantize_activations

    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(1))
    xq, xs = quantize_activations(x, 16)
    assert xq.shape == (rows, 40) and xq.dtype == torch.float8_e4m3fn and xs.shape == (rows, 3)
    back = xq.float() * xs.repeat_interleave(16, dim=1)[:, :40]
    torch.testing.assert_close(back, x, rtol=2**-3, atol=0)
    if rows:
        assert xq.float().abs().view(rows, -1)[:, :32].view(rows, 2, 16).amax(dim=2).eq(448).all()


# -- scales that do not fit their weights -------------------------------------------------------------------


def _rewritten(src, tmp_path, tensors=None, quantization=None):
    """A copy of the checkpoint folder `src` with its tensors changed by `tensors(dict) -> None` and its
    quantization_config by `quantization(dict) -> None`."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "rewritten"
    shutil.copytree(src, out)
    if tensors is not None:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    if quantization is not None:
        config = json.loads((out / "config.json").read_text())
        quantization(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    return out


def _double_columns(t):
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    t[name] = torch.cat([t[name], 2 * t[name]], dim=1)


@pytest.mark.parametrize(
    "fmt,tensors,quantization,named",
    [
        # the config's blocks twice as tall as those the scales were made for: half the scale rows
        (
            "fp8",
            None,
            lambda qc: qc.update(weight_block_size=[256, 128]),
            r"_proj\.weight_scale_inv.*are \[2, 4\], not \[1, 4\].*weight_block_size \[256, 128\]",
        ),
        # a per-channel scale with two columns
        ("compressed-tensors", _double_columns, None, r"gate_proj\.weight_scale.*\[512, 2\]"),
    ],
    ids=["blocks-of-another-size", "per-channel-two-columns"],
)
def test_scales_of_another_shape_than_the_weights_are_an_error_naming_the_tensor(
    checkpoints, tmp_path, fmt, tensors, quantization, named
):
    # each once loaded without a word, the wrong scales on the wrong rows, and answered other tokens
    path = _rewritten(checkpoints[fmt][0], tmp_path, tensors, quantization)
    with pytest.raises(CheckpointError, match=named):
        LLM(str(path))


def test_per_tensor_scales_stored_as_scalars_load_as_one_for_every_row(hd128, tmp_path):
    # compressed-tensors' "tensor" strategy; a scale saved as a 0-dim tensor once failed in the slicing
    import shutil

    from safetensors.torch import load_file, save_file

    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    for d in (fp8, ref):
        shutil.copytree(hd128, d)
    tensors = load_file(str(hd128 / "model.safetensors"))
    quantized, reference = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj", "o_proj"):
            continue
        scale = w.float().abs().max() / 448.0
        q = (w.float() / scale).to(FP8)
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale"] = q, scale.reshape(())
        reference[name] = q.float() * scale
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(reference, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    qc = quantization_config("compressed-tensors")
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    qc["ignore"] = ["lm_head", "re:.*mlp.*"]
    config["quantization_config"] = qc
    (fp8 / "config.json").write_text(json.dumps(config))
    prompts = _prompts(3)
    with checked_llm(fp8, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 8, ignore_eos=True)


def test_blocks_the_triton_kernels_cannot_step_through_are_an_error_where_they_run(needs_triton, tmp_path):
    from fp8_checkpoints import PROJECTIONS
    from safetensors.torch import load_file, save_file
    from tiny_checkpoints import build_checkpoint

    src = build_checkpoint("qwen3", tmp_path / "src")
    t = load_file(str(src / "model.safetensors"))
    for name in [k for k in t if k.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS]:
        t[name], t[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blocks(t[name], (96, 96))
    save_file(t, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**quantization_config("fp8"), "weight_block_size": [96, 96]}
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (src / "config.json").write_text(json.dumps(config))
    with checked_llm(src, page_size=4) as llm:  # the torch path takes any block
        assert llm.generate([[5, 17, 42]], greedy(3, ignore_eos=True))[0].token_ids
    with pytest.raises(QuantizationError, match=r"weight_block_size \[96, 96\].*power of two"):
        LLM(str(src), page_size=4, kernels=Kernels(interpret_on_cpu=True))


def test_a_checkpoints_kv_cache_scales_are_passed_over(checkpoints, tmp_path):
    # compressed-tensors' kv_cache_scheme saves each attention's k_scale and v_scale: once "no place for" them
    def add_scales(t):
        for i in range(2):
            for kind in ("k", "v"):
                t[f"model.layers.{i}.self_attn.{kind}_scale"] = torch.tensor(0.05)

    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    fp8, ref = checkpoints["compressed-tensors"]
    path = _rewritten(fp8, tmp_path, add_scales, lambda qc: qc.update(kv_cache_scheme=kv))
    prompts = _prompts(3)
    with checked_llm(path, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 8, ignore_eos=True)
