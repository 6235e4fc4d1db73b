"""Eager steps replayed from piecewise CUDA graphs (worker/extend_graphs.py): the bucket sizes on any
machine; on the GPU, a step through the graphs against the same step launched op by op (logits, tokens,
the KV it writes), padded tokens that never touch a request's KV, and whole generations (prompt
chunks, mixed steps, prefix-cache hits, an fp8 KV cache) against generations with the graphs off."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import greedy
from test_gpu import KV_TOKENS, agreement, run
from tiny_checkpoints import build_qwen3_hd128, random_prompts

from cluster import SamplingParams
from worker.batch import BatchDesc
from worker.config import EngineConfig
from worker.extend_graphs import extend_graph_bytes, extend_graph_sizes

gpu = pytest.mark.gpu


def test_buckets_double_from_16_with_midpoints_from_128_and_end_at_the_setting():
    assert extend_graph_sizes(2048) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert extend_graph_sizes(1000) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1000]
    assert extend_graph_sizes(16) == [16]
    assert extend_graph_sizes(10) == [10]
    for top in (100, 700, 3000, 8192):
        sizes = extend_graph_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))  # a step pads by less than itself
        assert all(2 * b <= 3 * a for a, b in zip(sizes, sizes[1:]) if a >= 128)  # from 128, by at most half


def test_the_graphs_memory_estimate_grows_with_the_tokens_and_shrinks_with_the_ranks(model_paths):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_paths["qwen3"])
    one, two = extend_graph_bytes(config, 1024, torch.bfloat16), extend_graph_bytes(config, 2048, torch.bfloat16)
    assert extend_graph_bytes(config, 0, torch.bfloat16) == 0 and 0 < one < two
    # the largest bucket's activations alone: q, k, v, gate-up and SiLU outputs, 4 hidden-wide tensors
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim + 3 * config.intermediate_size
    assert two >= 2048 * (widths + 4 * config.hidden_size) * 2
    assert extend_graph_bytes(config, 2048, torch.bfloat16, tp_size=2) < two
    assert extend_graph_bytes(config, 2048, torch.float32) == 2 * two


def test_a_full_draft_counts_its_graphs_and_a_head_none(model_paths, tmp_path):
    from tiny_checkpoints import build_eagle3_head

    from worker.draft_budget import draft_memory

    draft = draft_memory(model_paths["qwen3"], torch.bfloat16, torch.bfloat16, 16, extend_graph_tokens=2048)
    assert draft.graph_bytes > 0
    assert draft_memory(model_paths["qwen3"], torch.bfloat16, torch.bfloat16, 16).graph_bytes == 0
    head = build_eagle3_head(Path(model_paths["qwen3"]), tmp_path / "head")
    assert draft_memory(str(head), torch.bfloat16, torch.bfloat16, 16, extend_graph_tokens=2048).graph_bytes == 0


def test_an_engine_on_the_cpu_has_no_extend_graphs_and_cuda_graph_max_bs_0_turns_them_off(model_paths):
    from worker.engine import Engine

    engine = Engine(EngineConfig(model_paths["qwen3"], num_pages=64))
    assert engine.extend_graphs is None and engine.extend_graph_tokens == 2048
    assert not engine.replays(_prefill([[5, 6, 7]], [np.arange(3)]))
    off = Engine(EngineConfig(model_paths["qwen3"], num_pages=64, cuda_graph_max_bs=0))
    assert off.extend_graph_tokens == 0


class _Comm:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def broadcast_desc(self, desc) -> None:
        self.calls.append("broadcast")

    def post_with_first_collective(self, desc) -> None:
        self.calls.append("post at the first collective")

    def post_held(self) -> None:
        pass

    def withdraw_held(self) -> bool:
        return False


class _Engine:
    """What TensorParallelExecutor reads of rank 0's engine."""

    def __init__(self, replays: bool, calls: list[str]) -> None:
        self.tp = SimpleNamespace(comm=_Comm(calls))
        self._replays, self.calls = replays, calls

    def replays(self, desc) -> bool:
        return self._replays

    def forward(self, desc):
        self.calls.append("forward")


@pytest.mark.parametrize("replays", [True, False])
def test_rank_0_sends_a_step_whose_collectives_are_inside_graphs_before_it_launches(replays):
    from cluster.replica.engine_executors import TensorParallelExecutor

    calls: list[str] = []
    TensorParallelExecutor(_Engine(replays, calls), keepalive_s=60).launch(_prefill([[1, 2]], [np.arange(2)]))
    first = "broadcast" if replays else "post at the first collective"
    assert calls == [first, "forward"]


@pytest.fixture(scope="module")
def qwen3_hd128_path(tmp_path_factory: pytest.TempPathFactory):
    return build_qwen3_hd128(tmp_path_factory.mktemp("qwen3_hd128_extend"))


def _prefill(prompts: list[list[int]], locs: list[np.ndarray]) -> BatchDesc:
    n = len(prompts)
    lens = np.array([len(p) for p in prompts], dtype=np.int32)
    ones = np.ones(n, dtype=np.float32)
    return BatchDesc(
        True,
        slots=np.arange(n, dtype=np.int32),
        seq_lens=lens,
        extend_lens=lens,
        out_loc=np.concatenate([loc[: len(p)] for loc, p in zip(locs, prompts)]).astype(np.int32),
        input_ids=np.concatenate(prompts).astype(np.int32),
        temperature=ones * 0,
        top_p=ones,
        top_k=np.zeros(n, np.int32),
        seeds=np.zeros(n, np.int64),
    )


@gpu
def test_a_step_through_the_extend_graphs_equals_the_step_launched_op_by_op(qwen3_hd128_path):
    from worker.engine import Engine

    engine = Engine(EngineConfig(str(qwen3_hd128_path), dtype="bfloat16", page_size=16, num_pages=KV_TOKENS // 16))
    graphs = engine.extend_graphs
    assert graphs is not None and sorted(graphs.pieces) == extend_graph_sizes(2048)
    # one piece a layer's attention, and one after the last
    assert all(len(p.graphs) == engine.hf_config.num_hidden_layers + 1 for p in graphs.pieces.values())
    logits, used = [], []
    compute_logits, replay = engine.model.compute_logits, graphs.run
    engine.model.compute_logits = lambda h: logits.append(compute_logits(h).float()) or logits[-1]
    graphs.run = lambda tokens, *a: used.append(tokens) or replay(tokens, *a)
    k_cache = engine.kv.k(0)
    for lens, seed in (([3], 1), ([100, 37, 250], 2), ([700, 180], 3), ([1500, 500, 48], 4)):
        prompts = [np.random.default_rng(seed + i).integers(0, 360, n).tolist() for i, n in enumerate(lens)]
        locs = [np.arange(i * 2048, i * 2048 + n) for i, n in enumerate(lens)]
        desc = _prefill(prompts, locs)
        cells = torch.as_tensor(desc.out_loc, device="cuda").long()
        off, engine.extend_graphs = engine.extend_graphs, None
        eager = engine.forward(desc)  # the same KV and token writes both times: the step can run twice
        eager.done.synchronize()
        eager_kv = k_cache.view(-1, *k_cache.shape[-2:])[cells].float().clone()
        engine.extend_graphs = off
        graph = engine.forward(desc)
        graph.done.synchronize()
        assert used[-1] == graphs.bucket(sum(lens)) > 0
        torch.testing.assert_close(logits[-1], logits[-2], atol=0.05, rtol=0.02)
        assert graph.next_tokens.tolist() == eager.next_tokens.tolist()
        graph_kv = k_cache.view(-1, *k_cache.shape[-2:])[cells].float()
        torch.testing.assert_close(graph_kv, eager_kv, atol=0.05, rtol=0.02)


@gpu
def test_padded_tokens_write_the_scratch_page_not_the_cells_of_a_longer_step_before(qwen3_hd128_path):
    from worker.engine import Engine

    engine = Engine(EngineConfig(str(qwen3_hd128_path), dtype="bfloat16", page_size=16, num_pages=KV_TOKENS // 16))
    rng = np.random.default_rng(7)
    first = [rng.integers(0, 360, 700).tolist()]
    engine.forward(_prefill(first, [np.arange(700)])).done.synchronize()
    k = engine.kv.k(0)
    flat = k.view(-1, *k.shape[-2:])
    kept = flat[:700].clone()
    # a shorter step of the same bucket (768) in other cells: its padded rows cover where the first wrote
    second = [rng.integers(0, 360, 520).tolist()]
    assert engine.extend_graphs.bucket(520) == engine.extend_graphs.bucket(700)
    engine.forward(_prefill(second, [np.arange(4096, 4096 + 520)])).done.synchronize()
    assert torch.equal(flat[:700], kept)


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_generations_with_extend_graphs_agree_with_generations_without(qwen3_hd128_path, kv):
    # steps on both sides of the graphs' 1,024 tokens (prompt chunks of 1,536) and of several buckets;
    # 24 requests at once make mixed steps (decodes beside prompt chunks); the repeats hit the prefix cache
    prompts = random_prompts(20, 5, 900, seed=11)
    prompts += [random_prompts(1, 1800, 2000, seed=12)[0]] + prompts[:3]
    params = [greedy(6 + i % 7, ignore_eos=True, logprobs=4) for i in range(len(prompts))]
    common = dict(dtype="bfloat16", page_size=16, kv_cache_dtype=kv, max_running_reqs=32, max_extend_tokens=1536)
    off, off_tops = run(qwen3_hd128_path, prompts, params, extend_graph_tokens=0, **common)
    on, _ = run(qwen3_hd128_path, prompts, params, extend_graph_tokens=1024, **common)
    assert agreement(off, on, off_tops) >= 0.99


@gpu
def test_seeded_sampling_through_extend_graphs_draws_what_eager_steps_draw(qwen3_hd128_path):
    prompts = random_prompts(8, 20, 400, seed=13)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=3)
    common = dict(dtype="bfloat16", page_size=16)
    off, _ = run(qwen3_hd128_path, prompts, params, extend_graph_tokens=0, **common)
    on, _ = run(qwen3_hd128_path, prompts, params, **common)
    assert agreement(off, on) >= 0.95
