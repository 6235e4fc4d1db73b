"""An engine's kernel choices (worker/kernels.py) and its count of host waits are its own: two engines
in one process, built one after the other with different choices, each keep theirs."""

from __future__ import annotations

import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy
from test_fused_layers import STAND_INS

from cluster import SamplingParams
from worker import triton_ops
from worker.kernels import Kernels


def test_two_engines_in_one_process_keep_their_own_fused_kernel_choice(monkeypatch, qwen3_path):
    import worker.layers.mlp
    import worker.layers.norm
    import worker.layers.rotary

    fused_calls = []

    def stand_ins(x):  # FlashInfer's kernels, as tests/test_fused_layers.py stands them in on the CPU
        fused_calls.append(x.shape)
        return STAND_INS

    for module in (worker.layers.norm, worker.layers.rotary, worker.layers.mlp):
        monkeypatch.setattr(module, "fused_ops", stand_ins)
    with checked_llm(qwen3_path, kernels=Kernels(fused=False)) as unfused, checked_llm(qwen3_path) as fused:
        assert not unfused.engine.kernels.fused and fused.engine.kernels.fused
        prompts = encode_all(fused, PROMPT_TEXTS[:2])
        want = hf_greedy(qwen3_path, prompts, 4)
        fused_calls.clear()  # the fused engine's warm-up step
        # the engine built first still runs unfused once the second is built, and after the second ran
        assert [o.token_ids for o in unfused.generate(prompts, greedy(4))] == want and not fused_calls
        assert [o.token_ids for o in fused.generate(prompts, greedy(4))] == want and fused_calls
        fused_calls.clear()
        assert [o.token_ids for o in unfused.generate(prompts, greedy(4))] == want and not fused_calls


def test_two_engines_in_one_process_keep_their_own_triton_kernel_choice(monkeypatch, qwen3_path):
    pytest.importorskip("triton")
    launches = {"prologue": 0, "sample": 0}

    def counted(name, kernel):
        def launch(*args, **kwargs):
            launches[name] += 1
            return kernel(*args, **kwargs)

        return launch

    monkeypatch.setattr(triton_ops, "qkv_prologue", counted("prologue", triton_ops.qkv_prologue))
    monkeypatch.setattr(triton_ops, "sample_rows", counted("sample", triton_ops.sample_rows))
    seeded = SamplingParams(temperature=0.8, max_tokens=3, seed=7, ignore_eos=True)  # a draw: the sampler's kernel
    with (
        checked_llm(qwen3_path, kernels=Kernels(interpret_on_cpu=True)) as interpreted,
        checked_llm(qwen3_path) as plain,
    ):
        prompts = encode_all(plain, PROMPT_TEXTS[:2])
        launches.update(prologue=0, sample=0)  # the interpreted engine's warm-up step
        torch_tokens = [o.token_ids for o in plain.generate(prompts, seeded)]
        assert launches == {"prologue": 0, "sample": 0}
        triton_tokens = [o.token_ids for o in interpreted.generate(prompts, seeded)]
        assert launches["prologue"] > 0 and launches["sample"] > 0
        before = dict(launches)
        assert [o.token_ids for o in plain.generate(prompts, seeded)] == torch_tokens and launches == before
    assert triton_tokens == torch_tokens


def test_each_engine_counts_its_own_host_waits(qwen3_path):
    with checked_llm(qwen3_path) as first, checked_llm(qwen3_path) as second:
        assert first.engine.host_waits is not second.engine.host_waits
        prompts = encode_all(first, PROMPT_TEXTS[:1])
        waited = second.engine.host_waits.seconds
        first.generate(prompts, greedy(3))
        assert second.engine.host_waits.seconds == waited and first.engine.host_waits.seconds > 0


def test_the_prologue_warm_up_runs_every_tile_and_writes_only_the_scratch_cell(monkeypatch, qwen3_path):
    pytest.importorskip("triton")
    tiles = []
    prologue = triton_ops.qkv_prologue

    def noted(qkv, *args, **kwargs):
        tiles.append(triton_ops.prologue_tiles(qkv.shape[0]))
        return prologue(qkv, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "qkv_prologue", noted)
    with checked_llm(qwen3_path, kernels=Kernels(interpret_on_cpu=True)) as llm:
        engine = llm.engine
        layer = engine.model.model.layers[0].self_attn
        scratch = engine.scratch_page * engine.page_size
        before = engine.kv.buffer.clone()
        tiles.clear()
        layer.warm_prologue(engine.attn, scratch, engine.dtype)
        assert tiles == [tile for _, tile in triton_ops.PROLOGUE_TILES]
        changed = (engine.kv.buffer != before).flatten(3).any(-1)  # [k or v, layer, cell]: which cells moved
        assert changed.nonzero()[:, 2].unique().tolist() == [scratch]
        assert changed[:, 0].any(-1).all() and not changed[:, 1:].any()  # keys and values, layer 0 alone


@pytest.mark.parametrize(
    "kernels,device,capability,applies",
    [
        (Kernels(pdl="on"), "cuda", (9, 0), True),
        (Kernels(pdl="on"), "cuda", (10, 0), True),
        (Kernels(pdl="on"), "cuda", (8, 9), False),  # Ada: no programmatic dependent launch
        (Kernels(pdl="on"), "cpu", None, False),
        (Kernels(pdl="off"), "cuda", (9, 0), False),
        (Kernels(), "cuda", (9, 0), False),  # auto, unresolved by an engine: off
    ],
)
def test_programmatic_dependent_launch_applies_where_asked_on_a_gpu_that_has_it(
    monkeypatch, kernels, device, capability, applies
):
    monkeypatch.setattr(triton_ops, "_capability", lambda index: capability)
    assert triton_ops.pdl_applies(kernels, torch.device(device)) is applies
    assert triton_ops.pdl_options(applies) == ({"launch_pdl": True} if applies else {})


def test_a_pdl_gemv_prefetches_in_its_first_programs_only_over_a_small_weight():
    """Over a weight of at most PDL_PREFETCH_MAX_BYTES the first PDL_PREFETCH_PROGRAMS_PER_SM programs a
    multiprocessor prefetch; over a larger one none (a long kernel's prefetch only competes for the memory);
    an explicit count is kept, and nothing prefetches off a GPU."""
    per_sm, limit = triton_ops.PDL_PREFETCH_PROGRAMS_PER_SM, triton_ops.PDL_PREFETCH_MAX_BYTES
    assert triton_ops.default_prefetch_programs(limit, 132) == 132 * per_sm
    assert triton_ops.default_prefetch_programs(1024 * 6144 * 2, 132) == 132 * per_sm  # Qwen3-0.6B's gate-up
    assert triton_ops.default_prefetch_programs(limit + 1, 132) == 0
    assert triton_ops.default_prefetch_programs(4096 * 4096, 132) == 0  # Qwen3-8B's o in FP8
    assert triton_ops.prefetch_programs(torch.empty(4, 4), pdl=True) == 0
    assert triton_ops.prefetch_programs(torch.empty(4, 4), pdl=True, override=5) == 5
    assert triton_ops.prefetch_programs(torch.empty(4, 4), pdl=False, override=5) == 0  # nothing waits


@pytest.mark.parametrize("tp_size,resolved", [(1, "on"), (2, "off")])  # tensor parallelism: not measured
def test_pdl_auto_is_resolved_on_for_a_model_on_one_gpu(tp_size, resolved):
    kernels = Kernels(fused=False).with_model(tp_size)
    assert kernels == Kernels(fused=False, pdl=resolved)
    for asked in ("on", "off"):  # an explicit choice stays as it is
        assert Kernels(pdl=asked).with_model(tp_size).pdl == asked


def test_an_unknown_pdl_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="programmatic dependent launch mode True"):
        Kernels(pdl=True)


def test_an_engine_resolves_pdl_auto_before_it_builds_its_layers(qwen3_path, qwen3_moe_path):
    from worker.config import EngineConfig
    from worker.engine import Engine

    dense = Engine(EngineConfig(str(qwen3_path), num_pages=64))
    assert dense.kernels.pdl == "on"
    assert dense.model.lm_head.kernels.pdl == dense.kernels.pdl  # what its layers were built with
    assert Engine(EngineConfig(str(qwen3_moe_path), num_pages=64)).kernels.pdl == "on"
    assert Engine(EngineConfig(str(qwen3_path), num_pages=64, quantization="fp8")).kernels.pdl == "on"
    asked = Engine(EngineConfig(str(qwen3_path), num_pages=64, kernels=Kernels(pdl="off")))
    assert asked.kernels.pdl == "off"


def test_an_unknown_decode_merge_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown decode merge 'fused'; choose auto, launch, last"):
        Kernels(decode_merge="fused")


def test_an_unknown_decode_order_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown decode order 'random'; choose auto, rows, longest_first"):
        Kernels(decode_order="random")


def test_the_decode_order_resolves_auto_to_longest_first():
    assert Kernels().decode_longest_first
    assert Kernels(decode_order="longest_first").decode_longest_first
    assert not Kernels(decode_order="rows").decode_longest_first
    assert not Kernels().sorts_decode_rows


def test_sorted_rows_sorts_the_scheduler_s_rows_and_leaves_the_triton_kernel_in_row_order():
    kernels = Kernels(decode_order="sorted_rows")
    assert kernels.sorts_decode_rows and not kernels.decode_longest_first
