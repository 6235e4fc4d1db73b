"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against Hugging Face transformers: greedy
parity in both loops, every cache type, chunked prefill and page sizes, at tp 1 and 2, under preemption;
routing as transformers routes; each rank's slices of the per-expert checkpoint tensors and of those
stacking every expert's (transformers' own layout); the fused Triton experts against the torch loop (under
Triton's interpreter on the CPU, in bf16 and inside a CUDA graph on a GPU)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy
from transformers import AutoConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from worker.kernels import Kernels
from worker.layers.moe import select_experts
from worker.layers.moe.fused import align_by_expert, fused_applies, fused_experts, route
from worker.layers.moe.torch_experts import torch_experts
from worker.loader import CheckpointError, load_weights
from worker.models import build_model
from worker.parallel import TPGroup

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
INTERPRETED = Kernels(interpret_on_cpu=True)  # the Triton kernels on CPU tensors too (conftest sets TRITON_INTERPRET)


@pytest.mark.parametrize(
    "config",
    [
        MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2),
        Qwen2MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=4),
        Qwen2MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True),
    ],
)
def test_routing_picks_transformers_experts_and_weights(config):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    hf = (MixtralTopKRouter if isinstance(config, MixtralConfig) else Qwen2MoeTopKRouter)(config)
    torch.nn.init.normal_(hf.weight, std=0.3)
    x = torch.randn(33, 64)
    _, want_weights, want_ids = hf(x)
    renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises its top-k
    weights, ids = select_experts(x @ hf.weight.T, config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as HFQwen3Moe
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        vocab_size=100,
        architectures=["Qwen3MoeForCausalLM"],
    )
    ours = build_model(config, 64, TPGroup())
    theirs = HFQwen3Moe(config)
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in ours.model.layers]
    assert sparse == [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in theirs.model.layers]
    assert sparse == [False, True, False, False, False, True]


@pytest.mark.parametrize("family", MOE)
def test_greedy_output_in_the_overlap_loop_equals_hf_generate(moe_paths, family):
    """(tests/test_core.py checks every family in the normal loop.)"""
    path = moe_paths[family]
    with checked_llm(path, overlap=True) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        outs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 16)


@pytest.mark.parametrize(
    "family,overlap,cache_type,page_size,chunk",
    [
        ("qwen3_moe", True, "radix", 4, 7),
        ("qwen3_moe", False, "naive", 1, 8192),
        ("qwen2_moe", False, "radix", 1, 5),
        ("qwen2_moe", True, "naive", 16, 8192),
        ("mixtral", True, "radix", 16, 9),
        ("mixtral", False, "radix", 4, 8192),
    ],
)
def test_cache_types_chunked_prefill_and_page_sizes_equal_hf(moe_paths, family, overlap, cache_type, page_size, chunk):
    path = moe_paths[family]
    with checked_llm(path, overlap=overlap, cache_type=cache_type, page_size=page_size, max_extend_tokens=chunk) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        first = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        assert [o.token_ids for o in llm.generate(prompts, greedy(10))] == first  # warm prefix cache
    assert first == hf_greedy(path, prompts, 10)


@pytest.mark.parametrize("family", MOE)
def test_preempted_requests_recompute_to_hf_output(moe_paths, family):
    path = moe_paths[family]
    with checked_llm(path, page_size=4, num_pages=80, decode_reserve_tokens=1) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        outs = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        assert llm.stats().preempted > 0
    assert outs == hf_greedy(path, prompts, 10)


@pytest.mark.parametrize(
    "family,overlap,cache_type,preempting",
    [("qwen3_moe", True, "radix", True), ("qwen2_moe", False, "naive", False), ("mixtral", True, "radix", False)],
)
def test_tp2_greedy_equals_hf(ray_cluster, moe_paths, family, overlap, cache_type, preempting):
    path = moe_paths[family]
    kw = dict(
        overlap=overlap,
        cache_type=cache_type,
        page_size=4,
        **(dict(num_pages=80, decode_reserve_tokens=1) if preempting else {}),
    )
    with checked_llm(path, tp_size=2, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        outs = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        assert (llm.stats().preempted > 0) == preempting
    assert outs == hf_greedy(path, prompts, 10)


@pytest.mark.parametrize("family", MOE)
def test_each_rank_holds_its_slice_of_every_experts_weights(moe_paths, family):
    from safetensors import safe_open

    path = moe_paths[family]
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, 64, TPGroup(rank=1, size=2))
    load_weights(model, path, progress=False)
    block = model.model.layers[-1].mlp
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    prefix = f"model.layers.{len(model.model.layers) - 1}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}"
    local = block.experts.down_proj.local
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for e in range(block.experts.num_experts):
            gate, up, down = (f.get_tensor(f"{prefix}.experts.{e}.{n}.weight") for n in names)
            w13, w2 = block.experts.gate_up_proj.weight[e], block.experts.down_proj.weight[e]
            assert torch.equal(w13[:local], gate[local:])
            assert torch.equal(w13[local:], up[local:])
            assert torch.equal(w2, down[:, local:])
        assert torch.equal(block.gate.weight, f.get_tensor(f"{prefix}.gate.weight"))


def test_a_missing_expert_tensor_is_named(qwen3_moe_path, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_moe_path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        load_weights(build_model(AutoConfig.from_pretrained(tmp_path / "m"), 64, TPGroup()), tmp_path / "m")


@pytest.mark.parametrize("part,shape", [("gate_proj", (64, 64)), ("down_proj", (64, 48))])
def test_an_expert_tensor_of_another_shape_is_named(qwen3_moe_path, tmp_path, part, shape):
    # once loaded a wrong slice of it without a word
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_moe_path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    name = f"model.layers.0.mlp.experts.3.{part}.weight"
    weights[name] = torch.zeros(shape)
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(name) + r"'.*" + re.escape(f"{list(shape)}, but")):
        load_weights(build_model(AutoConfig.from_pretrained(tmp_path / "m"), 64, TPGroup()), tmp_path / "m")


@pytest.fixture(scope="module")
def stacked_paths(moe_paths, tmp_path_factory):
    """Each family's checkpoint saved by transformers in its own layout (`save_original_format=False`): every
    expert's projection stacked in one tensor a layer."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    paths = {}
    for family, path in moe_paths.items():
        out = tmp_path_factory.mktemp(f"{family}_stacked")
        shutil.copytree(path, out, dirs_exist_ok=True)
        AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, save_original_format=False)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the layout this tests, not the published one
        assert not any(".experts.0." in name for name in names)
        paths[family] = out
    return paths


@pytest.mark.parametrize("family", MOE)
def test_experts_stacked_as_transformers_saves_them_equal_hf(stacked_paths, family):
    path = stacked_paths[family]
    with checked_llm(path, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        outs = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    assert outs == hf_greedy(path, prompts, 10)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_slice_of_stacked_experts_as_of_published_ones(moe_paths, stacked_paths, family, rank):
    def loaded(path):
        model = build_model(AutoConfig.from_pretrained(path), 64, TPGroup(rank=rank, size=2))
        load_weights(model, path, progress=False)
        return model.state_dict()

    published, stacked = loaded(moe_paths[family]), loaded(stacked_paths[family])
    assert published.keys() == stacked.keys()
    assert all(torch.equal(published[name], stacked[name]) for name in published)


def test_stacked_experts_quantized_at_load_equal_published_ones_quantized(moe_paths, stacked_paths):
    """`quantization="fp8"` quantizes each expert of a stacked tensor as it is read, as a published one's."""
    pytest.importorskip("triton")
    got = []
    for path in (moe_paths["qwen3_moe"], stacked_paths["qwen3_moe"]):
        with checked_llm(path, page_size=4, quantization="fp8", kernels=Kernels(interpret_on_cpu=True)) as llm:
            blocks = [layer.mlp.experts for layer in llm.engine.model.model.layers if hasattr(layer.mlp, "experts")]
            got.append([(b.gate_up_proj.weight, b.down_proj.weight, b.scales()) for b in blocks])
    for (gu, dn, scales), (sgu, sdn, sscales) in zip(*got, strict=True):
        assert gu.dtype == torch.float8_e4m3fn
        assert torch.equal(gu.float(), sgu.float()) and torch.equal(dn.float(), sdn.float())
        assert torch.equal(scales.gate_up, sscales.gate_up) and torch.equal(scales.down, sscales.down)


@pytest.mark.parametrize("part,shape", [("gate_up_proj", (8, 32, 64)), ("down_proj", (8, 32, 64))])
def test_a_stacked_expert_tensor_of_another_shape_is_named(stacked_paths, tmp_path, part, shape):
    from safetensors.torch import load_file, save_file

    shutil.copytree(stacked_paths["qwen3_moe"], tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    name = f"model.layers.0.mlp.experts.{part}"
    want = list(weights[name].shape)
    weights[name] = torch.zeros(shape)
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{name}'") + r".*" + re.escape(f"{list(shape)}, but")) as e:
        load_weights(build_model(AutoConfig.from_pretrained(tmp_path / "m"), 64, TPGroup()), tmp_path / "m")
    assert str(want) in str(e.value)


def test_a_stacked_expert_tensor_of_no_known_name_is_an_error_saying_how_experts_are_read(qwen3_moe_path, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_moe_path, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    prefix = "model.layers.0.mlp.experts"
    weights[f"{prefix}.gate_up_proj_scale_inv"] = torch.ones(8, 1, 1)
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scale_inv'.*one tensor each.*stacked as transformers"):
        load_weights(build_model(AutoConfig.from_pretrained(tmp_path / "m"), 64, TPGroup()), tmp_path / "m")


def test_a_qwen2_moe_whose_shared_expert_is_zero_wide_equals_hf(tmp_path):
    # transformers saves the empty shared expert and its gate; both add nothing, and were refused at load
    from tiny_checkpoints import build_checkpoint, random_prompts

    path = build_checkpoint("qwen2_moe", tmp_path / "m", overrides={"shared_expert_intermediate_size": 0})
    prompts = random_prompts(3, 4, 20, seed=3)
    with checked_llm(path, page_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    assert got == hf_greedy(path, prompts, 8, ignore_eos=True)


@pytest.mark.parametrize("family", MOE)
def test_dummy_weights_fill_the_stacked_experts(moe_paths, family, tmp_path):
    shutil.copy(moe_paths[family] / "config.json", tmp_path / "config.json")
    with checked_llm(tmp_path, load_format="dummy") as llm:
        experts = llm.engine.model.model.layers[-1].mlp.experts
        for stacked in (experts.gate_up_proj.weight, experts.down_proj.weight):
            assert (stacked.std(dim=(1, 2)) > 0).all()  # every expert drawn, none left empty
        out = llm.generate([[1, 2, 3]], greedy(4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def _experts(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype=torch.float32, device="cpu", seed=0
):
    """Random inputs of one MoE block's experts: x, w13, w2 and a routing of x's tokens."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + tokens * 31 + num_experts)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen, device=device)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights.to(dtype), ids


@pytest.mark.parametrize("kernel,chunk", [(False, None), (True, 1024), (True, 16)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_align_by_expert_puts_every_row_once_in_blocks_of_its_expert(kernel, chunk, id_dtype, monkeypatch):
    """Both sorts (the kernel's, in one chunk of rows and in several, and torch's for the longest
    prompts' rows), over select_experts' int64 ids and the route kernel's int32 ones."""
    if kernel:
        pytest.importorskip("triton")
        from worker.layers.moe import fused

        monkeypatch.setattr(fused, "ALIGN_CHUNK", chunk)
    _, _, _, _, ids = _experts(13, 8, 3, 16, 16)
    ids = ids.to(id_dtype)
    order = align_by_expert(ids, 8, block_m=4, kernel=kernel)
    rows = ids.numel()
    blocks = order.sorted_ids.view(-1, 4)
    assert blocks.shape[0] == order.expert_ids.numel() == -(-(rows + 8 * 3) // 4)  # the static upper bound
    real = order.sorted_ids[order.sorted_ids < rows]
    assert sorted(real.tolist()) == list(range(rows))
    for block, expert in zip(blocks, order.expert_ids.tolist()):
        chosen = block[block < rows]
        if expert < 0:
            assert chosen.numel() == 0
        else:
            assert (ids.flatten()[chosen] == expert).all() and chosen.numel() > 0
    assert int(order.num_padded) == 4 * int((order.expert_ids >= 0).sum())


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_kernel_picks_what_select_experts_picks(renormalize):
    pytest.importorskip("triton")
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(3)) * 2
    weights, ids = route(logits, 3, renormalize)
    want_weights, want_ids = select_experts(logits, 3, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_routing_kernel_at_qwen3_moes_width_and_past_the_softmaxs_underflow():
    """128 experts, 8 a token (Qwen3-30B-A3B), over logits spread so wide that most probabilities are 0.0
    in float32: the kernel's picks and weights are select_experts' wherever the k-th probability is not 0."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(5)
    logits = torch.cat([torch.randn(6, 128, generator=generator), torch.randn(6, 128, generator=generator) * 40])
    weights, ids = route(logits, 8, True)
    want_weights, want_ids = select_experts(logits, 8, True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_routing_with_a_copy_of_the_logits_a_warp_picks_as_with_one():
    """On the GPU the per-row kernels route with one copy of the logits for each of their warps (COPIES);
    under the interpreter the launchers pass one. Four copies pick the same experts and weights."""
    pytest.importorskip("triton")
    from worker.layers.moe import fused

    logits = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))
    want_weights, want_ids = route(logits, 8, True)
    weights, ids = torch.empty_like(want_weights), torch.empty_like(want_ids)
    fused._kernels().moe_route_kernel[(5,)](
        logits, weights, ids, 128, logits.stride(0), TOP_K=8, K_P2=8, E_P2=128, RENORMALIZE=True, COPIES=4
    )
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_routing_kernel_breaks_ties_toward_the_lower_expert():
    """Equal probabilities go to the lower expert index first (the per-row kernels route with the same
    function)."""
    pytest.importorskip("triton")
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 1.0  # three equal leaders, then thirteen equal others
    weights, ids = route(logits, 5, False)
    assert ids[0].tolist() == [3, 9, 12, 0, 1]
    assert ids[1].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(weights.float(), torch.softmax(logits, -1).gather(1, ids.long()))


@pytest.mark.parametrize("per_row", [False, True, "down in a loop"])
@pytest.mark.parametrize(
    "tokens,num_experts,top_k,hidden,inter",
    [(1, 8, 2, 64, 32), (7, 4, 2, 48, 40), (40, 8, 4, 32, 16), (2, 8, 3, 40, 24)],
)
def test_fused_experts_equal_the_torch_loop_under_the_interpreter(
    tokens, num_experts, top_k, hidden, inter, per_row, monkeypatch
):
    """Both fused paths: the grouped GEMMs over rows sorted by expert, and the per-row kernels (their down
    kernel's default, which loads every choice at once, and its loop over choices)."""
    pytest.importorskip("triton")
    from worker.layers.moe import fused

    if per_row == "down in a loop":
        monkeypatch.setattr(fused, "PER_ROW_DOWN_AT_ONCE", None)
        per_row = True
    x, w13, w2, weights, ids = _experts(tokens, num_experts, top_k, hidden, inter)
    assert fused_applies(INTERPRETED, x) and not fused_applies(Kernels(moe="torch", interpret_on_cpu=True), x)
    got = fused_experts(x, w13, w2, weights, ids, per_row=per_row)
    torch.testing.assert_close(got, torch_experts(x, w13, w2, weights, ids))


def test_a_long_prompts_rows_sorted_by_torch_equal_the_torch_loop(monkeypatch):
    """Past ALIGN_KERNEL_MAX_ROWS rows (a prompt chunk of over 2,048 tokens at 8 experts a token) torch
    sorts the route kernel's int32 ids: fused_moe there equals the torch loop."""
    pytest.importorskip("triton")
    from worker.layers.moe import fused

    monkeypatch.setattr(fused, "ALIGN_KERNEL_MAX_ROWS", 0)
    x, w13, w2, _, _ = _experts(20, 8, 2, 32, 16)
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(6))
    want = torch_experts(x, w13, w2, *select_experts(logits, 2, True))
    torch.testing.assert_close(fused.fused_moe(x, logits, w13, w2, 2, True), want)


@pytest.mark.parametrize("renormalize", [False, True])
def test_per_row_kernels_route_as_select_experts_does(renormalize):
    """fused_moe at a few tokens routes inside the per-row kernels: the experts and weights that
    select_experts picks, so the output equals the torch loop's."""
    pytest.importorskip("triton")
    from worker.layers.moe.fused import fused_moe, per_row_applies

    x, w13, w2, _, _ = _experts(3, 64, 4, 32, 24)
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 2
    assert per_row_applies(3 * 4, 64)
    want = torch_experts(x, w13, w2, *select_experts(logits, 4, renormalize))
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 4, renormalize), want)


def test_engine_with_fused_experts_equals_hf_greedy(qwen2_moe_path):
    pytest.importorskip("triton")
    with checked_llm(qwen2_moe_path, page_size=4, kernels=INTERPRETED) as llm:
        assert fused_applies(llm.engine.kernels, torch.zeros(1))
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        outs = [o.token_ids for o in llm.generate(prompts, greedy(6))]
    assert outs == hf_greedy(qwen2_moe_path, prompts, 6)


# Qwen3-30B-A3B's expert shapes (one rank's slice at tp 1)
_ARCH = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,per_row",
    [(1, True), (1, False), (1, "down in a loop"), (4, True), (4, "down in a loop"), (5, None), (64, None)]
    + [(300, None)],
)
def test_fused_experts_agree_with_the_torch_loop_in_bf16_on_gpu(tokens, per_row, monkeypatch):
    """bf16 inputs; the reference is the torch loop in float32 on the same bf16 values. Tolerance: the
    largest error within 2% of the largest output (bf16 keeps 8 bits: 0.4% per rounding), and no worse
    than twice the bf16 torch loop's own. Both paths at a few tokens (the per-row kernels by default, their
    down kernel's loop over choices too)."""
    from worker.layers.moe import fused

    if per_row == "down in a loop":
        monkeypatch.setattr(fused, "PER_ROW_DOWN_AT_ONCE", None)
        per_row = True
    x, w13, w2, weights, ids = _experts(tokens, **_ARCH, dtype=torch.bfloat16, device="cuda")
    want = torch_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = fused_experts(x, w13, w2, weights, ids, per_row=per_row).float()
    loop = torch_experts(x, w13, w2, weights, ids).float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.02 * scale
    assert (got - want).abs().max() <= 2 * (loop - want).abs().max() + 1e-3 * scale


@pytest.mark.gpu
def test_per_row_routing_replays_in_a_cuda_graph():
    """fused_moe at 2 tokens (routing inside the per-row kernels) captured once and replayed on new
    inputs gives what it gives eagerly, and what the torch loop gives on select_experts' routing."""
    from worker.layers.moe.fused import fused_moe

    x, w13, w2, _, _ = _experts(2, **_ARCH, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(2, _ARCH["num_experts"], device="cuda", dtype=torch.bfloat16)
    fused_moe(x, logits, w13, w2, 8, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, w13, w2, 8, True)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, logits, w13, w2, 8, True), atol=0, rtol=0)
    want = torch_experts(x.float(), w13.float(), w2.float(), *select_experts(logits.float(), 8, True))
    assert (out.float() - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.gpu
def test_fused_experts_replay_in_a_cuda_graph():
    """The sort by expert and both GEMMs inside one captured graph (no host sync), replayed on new inputs."""
    x, w13, w2, weights, ids = _experts(8, **_ARCH, dtype=torch.bfloat16, device="cuda")
    fused_experts(x, w13, w2, weights, ids)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    new_x, _, _, new_weights, new_ids = _experts(8, **_ARCH, dtype=torch.bfloat16, device="cuda", seed=1)
    for buf, new in zip((x, weights, ids), (new_x, new_weights, new_ids)):
        buf.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, fused_experts(new_x, w13, w2, new_weights, new_ids), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE)
def test_fused_path_on_gpu_matches_hf_in_float32(moe_paths, family):
    """The engine on the GPU with the fused kernels (float32 stays IEEE float32 in them) and the torch
    attention backend (FlashInfer has no float32 kernels): greedy tokens equal transformers' on the CPU."""
    path = moe_paths[family]
    with checked_llm(path, kernels=Kernels(attention="torch"), dtype="float32", num_pages=4096, overlap=False) as llm:
        assert llm.engine.device.type == "cuda" and fused_applies(llm.engine.kernels, torch.zeros(1, device="cuda"))
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        outs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 16)


def test_a_tp_size_that_does_not_divide_the_experts_width_is_refused(qwen3_moe_path, tmp_path):
    import json

    from cluster.config import ConfigError, ServeConfig

    config = json.loads((qwen3_moe_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 34}))
    with pytest.raises(ConfigError, match="moe_intermediate_size 34"):
        ServeConfig().override(model=str(tmp_path), tp_size=4).check_against_model()


@pytest.mark.parametrize("dense_layers,refused", [([], False), ([1], True)])
def test_the_dense_width_must_split_across_ranks_only_where_a_layer_is_dense(
    qwen3_moe_path, tmp_path, dense_layers, refused
):
    import json

    from cluster.config import ConfigError, ServeConfig

    config = json.loads((qwen3_moe_path / "config.json").read_text())
    odd = {**config, "intermediate_size": 127, "mlp_only_layers": dense_layers, "decoder_sparse_step": 1}
    (tmp_path / "config.json").write_text(json.dumps(odd))
    check = ServeConfig().override(model=str(tmp_path), tp_size=2).check_against_model
    if refused:
        with pytest.raises(ConfigError, match="intermediate_size 127"):
            check()
    else:
        check()  # every layer sparse: intermediate_size is no layer's width


class _Launches:
    """Stands in for the fused path's kernels module: records each launch's kernel and compile-time
    arguments (what a GPU would compile a variant for) and computes nothing, except the routing's ids."""

    def __init__(self) -> None:
        self.seen: set = set()

    def __getattr__(self, name: str):
        def grid(_):
            def launch(*args, **kwargs):
                self.seen.add((name, tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))))
                if name == "moe_route_kernel":  # args: logits, weights, ids, num_experts
                    args[2].copy_(torch.arange(args[2].numel()).view_as(args[2]) % args[3])

            return launch

        return type("Kernel", (), {"__getitem__": lambda _, g: grid(g)})()


@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (8, 2), (60, 4), (130, 8)])
def test_warm_token_counts_take_every_variant_of_the_fused_path(num_experts, top_k, monkeypatch):
    """An engine's warm-up runs the fused path at these counts: between them they launch every kernel
    with every set of compile-time arguments that any token count does (recorded at the launches), so no
    live step compiles one."""
    from worker.layers.moe import fused

    launches = _Launches()
    monkeypatch.setattr(fused, "_kernels", lambda: launches)
    hidden, inter = 8, 4
    w13, w2 = torch.zeros(num_experts, 2 * inter, hidden), torch.zeros(num_experts, hidden, inter)

    def variants(tokens: int) -> frozenset:
        launches.seen = set()
        fused.fused_moe(torch.zeros(tokens, hidden), torch.zeros(tokens, num_experts), w13, w2, top_k, True)
        return frozenset(launches.seen)

    counts = fused.warm_token_counts(num_experts, top_k)
    assert counts == sorted(counts) and counts[0] == 1
    warmed = set().union(*(variants(t) for t in counts))
    last = (max(128 * num_experts, fused.ALIGN_KERNEL_MAX_ROWS) // top_k) + 2  # past every bound
    every = set().union(*(variants(t) for t in range(1, last + 1)))
    assert warmed == every


def test_grouped_tiles_too_large_for_the_gpu_fall_back_to_smaller_ones(monkeypatch):
    """Tiles that need more than the GPU has (Triton's OutOfResources at launch) give way to
    FALLBACK_TILES, for that block height and dtype from then on; any other error is raised."""
    from worker.layers.moe import fused

    class OutOfResources(Exception):  # what Triton raises, matched by name
        pass

    launched = []

    class Kernels:
        def __getattr__(self, name):
            def launch(*args, **kwargs):
                if name == "moe_gate_up_kernel" and kwargs["BLOCK_K"] == 128:
                    raise OutOfResources("shared memory")
                launched.append((name, kwargs.get("BLOCK_N"), kwargs.get("BLOCK_K")))

            return type("Kernel", (), {"__getitem__": lambda _, g: launch})()

    monkeypatch.setattr(fused, "_kernels", lambda: Kernels())
    monkeypatch.setattr(fused, "_FELL_BACK", set())
    monkeypatch.setattr(fused, "GROUPED_TILES", {16: (64, 128, 4, 3)})
    monkeypatch.setattr(fused, "FALLBACK_TILES", {16: (32, 64, 4, 3)})
    monkeypatch.setattr(fused, "ALIGN_KERNEL_MAX_ROWS", 0)  # torch's sort: no kernel to fake there
    hidden, inter, experts = 256, 128, 16
    x, w13, w2 = torch.zeros(3, hidden), torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    ids = torch.arange(6).view(3, 2)
    for _ in range(2):
        fused.fused_experts(x, w13, w2, torch.ones(3, 2), ids, per_row=False)
    assert launched == [("moe_gate_up_kernel", 32, 64), ("moe_down_kernel", 32, 64)] * 2
    # None: bf16 experts, no FP8 scale groups; False: activations not quantized
    assert fused._FELL_BACK == {(16, torch.float32, x.device, None, False)}

    def broken(*args, **kwargs):
        raise RuntimeError("not a matter of size")

    monkeypatch.setattr(fused, "_FELL_BACK", set())
    monkeypatch.setattr(fused, "_grouped_gemms", broken)
    with pytest.raises(RuntimeError, match="not a matter of size"):
        fused.fused_experts(x, w13, w2, torch.ones(3, 2), ids, per_row=False)
