"""The fused-kernel path of the layers (FlashInfer's kernels on CUDA), checked on the CPU: the kernels
are replaced by torch stand-ins with FlashInfer's documented semantics (in place where FlashInfer is),
so what is verified is how the layers call them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy


def _norm(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fused_add_rmsnorm(x, residual, w, eps):
    residual.add_(x)
    x.copy_(_norm(residual, w, eps))


def _rope_inplace(positions, query, key, head_size, cos_sin, is_neox):
    assert is_neox and cos_sin.dtype == torch.float32
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    for t in (query, key):
        x = t.view(t.shape[0], -1, head_size)
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


STAND_INS = SimpleNamespace(
    rmsnorm=lambda x, w, eps: _norm(x, w, eps),
    fused_add_rmsnorm=_fused_add_rmsnorm,
    rope_inplace=_rope_inplace,
    silu_and_mul=lambda t: F.silu(t[..., : t.shape[-1] // 2]) * t[..., t.shape[-1] // 2 :],
)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_layers_on_the_fused_path_match_hf(monkeypatch, model_paths, family):
    import worker.layers.mlp
    import worker.layers.norm
    import worker.layers.rotary

    for module in (worker.layers.norm, worker.layers.rotary, worker.layers.mlp):
        monkeypatch.setattr(module, "fused_ops", lambda x: STAND_INS)
    path = model_paths[family]
    with checked_llm(path) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        outs = llm.generate(prompts, greedy(10))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 10)


def test_a_graph_decode_step_stages_one_block_that_the_bucket_views_read_back(qwen3_path):
    # the CUDA-graph decode path on the CPU: Engine._stage packs a step's per-row inputs into one block
    # (worker/graph_io.py) and the graph reads it through its bucket's views of the static buffer
    import numpy as np

    from worker.batch import BatchDesc
    from worker.config import EngineConfig
    from worker.cuda_graph import _Bucket
    from worker.engine import Engine
    from worker.graph_io import IO, SAMPLER_IO, io_pads

    engine = Engine(EngineConfig(str(qwen3_path), page_size=4, num_pages=64, max_running_reqs=8))
    # what _stage reads of the graph runner
    engine.graphs = SimpleNamespace(pad=io_pads(999, engine.table.scratch_cell))
    desc = BatchDesc(
        False,
        slots=np.array([3, 0, 5], np.int32),
        seq_lens=np.array([9, 17, 4], np.int32),
        extend_lens=np.ones(3, np.int32),
        out_loc=np.array([40, 81, 130], np.int32),
        input_ids=None,
        temperature=np.array([0.0, 0.7, 1.5], np.float32),
        top_p=np.array([1.0, 0.9, 1.0], np.float32),
        top_k=np.array([-1, -1, 20], np.int32),
        seeds=np.array([1, 2, 1 << 40], np.int64),
    )
    s = engine._stage(desc, 4)
    assert not s.sampling.all_greedy and s.sampling.filtered and not s.sampling.procs
    io = torch.zeros(IO.nbytes(8), dtype=torch.uint8)
    io[: s.graph_io.numel()].copy_(s.graph_io)
    b = _Bucket(io, 4)
    # the filter's arguments travel in the second block, padded past the real rows
    sio = torch.zeros(SAMPLER_IO.nbytes(8), dtype=torch.uint8)
    sio[: s.sampling.sampler_io.numel()].copy_(s.sampling.sampler_io)
    b.bind_sampler_io(sio)
    assert b.sampler_args["top_p"].tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert b.sampler_args["top_k"].tolist() == [-1, -1, 20, -1] and b.sampler_args["state_row"].tolist() == [8] * 4
    row = engine.table.token_pool.shape[1]
    slots, seq = desc.slots.astype(np.int64), desc.seq_lens.astype(np.int64)
    assert b.token_read.tolist() == (slots * row + seq - 1).tolist() + [0]
    assert b.positions.tolist() == (seq - 1).tolist() + [0]
    assert b.out_loc.tolist() == [40, 81, 130, 999]
    assert b.token_write.tolist() == (slots * row + seq).tolist() + [engine.table.scratch_cell]
    assert b.io["seeds"].tolist() == [1, 2, 1 << 40, 0] and b.sample_pos.tolist() == [9, 17, 4, 0]
    assert b.io["temperature"].tolist() == pytest.approx([0.0, 0.7, 1.5, 0.0])
    s.staged.release()
    greedy = engine._stage(
        BatchDesc(
            False,
            slots=desc.slots,
            seq_lens=desc.seq_lens,
            extend_lens=desc.extend_lens,
            out_loc=desc.out_loc,
            input_ids=None,
            temperature=desc.temperature * 0,
            top_p=desc.top_p,
            top_k=desc.top_k,
            seeds=desc.seeds,
        ),
        4,
    )
    assert greedy.sampling.all_greedy and not greedy.sampling.filtered and greedy.sampling.sampler_io is None
    greedy.staged.release()
