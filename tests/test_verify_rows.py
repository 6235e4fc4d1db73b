"""A verify step (speculative decoding) run as decode rows, one a sample, so that a decode CUDA graph
replays it: each row's slot, length, KV location, input cell and sampling columns, and where penalties
count proposals, the (sample, proposal) pairs; the steps that stay extend steps (prompt logprobs,
prompt chunks, too many rows); and on an engine, the decode rows score and sample as the extend step
does, penalties too, and keep the same counts."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from worker.batch import BatchDesc
from worker.sampling.processors import ProcessorRows
from worker.verify_rows import verify_as_decode

POOL_ROW = 100


def verify_desc(**over) -> BatchDesc:
    """Two rows: slot 3 verifies proposals 40 and 41 after its input at position 7; slot 5 none."""
    desc = BatchDesc(
        True,
        slots=np.array([3, 5], np.int32),
        seq_lens=np.array([10, 7], np.int32),
        extend_lens=np.array([3, 1], np.int32),
        out_loc=np.array([100, 101, 102, 200], np.int32),
        input_ids=np.array([-1, 40, 41, -1], np.int32),
        temperature=np.array([0.0, 0.8], np.float32),
        top_p=np.array([1.0, 0.9], np.float32),
        top_k=np.array([-1, 5], np.int32),
        seeds=np.array([11, 12], np.int64),
        spec_lens=np.array([2, 0], np.int32),
    )
    return replace(desc, **over)


def test_a_verify_step_becomes_one_decode_row_per_sample():
    procs = ProcessorRows.idle(2, scratch_row=8)
    v = verify_as_decode(verify_desc(procs=procs, min_p=np.array([0.0, 0.1], np.float32)), 8, POOL_ROW, 8)
    d = v.desc
    assert not d.is_prefill and d.input_ids is None and d.spec_lens is None
    assert d.slots.tolist() == [3, 3, 3, 5]
    assert d.seq_lens.tolist() == [8, 9, 10, 7]  # each sample sees its row's tokens up to its own
    assert d.extend_lens.tolist() == [1] * 4 and d.out_loc.tolist() == [100, 101, 102, 200]
    assert d.temperature.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.8]) and d.top_k.tolist() == [-1, -1, -1, 5]
    assert d.seeds.tolist() == [11, 11, 11, 12] and d.min_p.tolist() == pytest.approx([0, 0, 0, 0.1])
    assert d.procs.state_row.tolist() == [8] * 4
    # the proposals go where the rows after them read their input (position p: cell slot * row + p)
    assert v.pool_cells.tolist() == [3 * POOL_ROW + 8, 3 * POOL_ROW + 9] and v.pool_tokens.tolist() == [40, 41]
    assert v.spec.rows.tolist() == [0, 0, 0, 1] and v.spec.drafts.tolist() == [40, 41, -1, -1]


def test_a_verify_step_whose_penalties_count_proposals_carries_each_samples_proposals_before_it():
    idle = verify_as_decode(verify_desc(procs=ProcessorRows.idle(2, scratch_row=8)), 8, POOL_ROW, 8)
    assert not idle.counts and idle.spec.proposed_at.size == 0
    counted = ProcessorRows.idle(2, scratch_row=8)
    counted.state_row[0] = 3  # penalties count the proposals before each sample
    v = verify_as_decode(verify_desc(procs=counted), 8, POOL_ROW, 8)
    assert v is not None and v.counts
    assert v.desc.procs.state_row.tolist() == [3, 3, 3, 8]
    # sample 1 comes after proposal 40, sample 2 after 40 and 41
    pairs = sorted(zip(v.spec.proposed_at.tolist(), v.spec.proposed_token.tolist()))
    assert pairs == [(1, 40), (2, 40), (2, 41)]


def test_a_verify_step_stays_an_extend_step_where_decode_rows_cannot_run_it():
    assert verify_as_decode(verify_desc(), 8, POOL_ROW, 3) is None  # four samples, three rows
    assert verify_as_decode(verify_desc(plp_idx=np.array([0], np.int32)), 8, POOL_ROW, 8) is None
    chunk = verify_desc(extend_lens=np.array([3, 4], np.int32), out_loc=np.arange(7, dtype=np.int32))
    assert verify_as_decode(chunk, 8, POOL_ROW, 8) is None  # a prompt chunk beside the verify rows
    assert verify_as_decode(replace(verify_desc(), spec_lens=None), 8, POOL_ROW, 8) is None


def test_a_graph_replays_the_decode_rows_of_a_verify_step(qwen3_path):
    from worker.config import EngineConfig
    from worker.cuda_graph import _Bucket
    from worker.engine import Engine
    from worker.graph_io import IO, io_pads

    engine = Engine(EngineConfig(str(qwen3_path), page_size=4, num_pages=64, max_running_reqs=8))
    engine.graphs = SimpleNamespace(pad=io_pads(999, engine.table.scratch_cell))  # what _stage reads of it
    row = engine.table.token_pool.shape[1]
    v = verify_as_decode(verify_desc(), engine.proc_state.scratch_row, row, 8)
    s = engine._stage(v.desc, 4, v)
    io = torch.zeros(IO.nbytes(8), dtype=torch.uint8)
    io[: s.graph_io.numel()].copy_(s.graph_io)
    b = _Bucket(io, 4)
    assert b.positions.tolist() == [7, 8, 9, 6]
    assert b.token_read.tolist() == [3 * row + 7, 3 * row + 8, 3 * row + 9, 5 * row + 6]
    assert b.token_write.tolist() == [3 * row + 8, 3 * row + 9, 3 * row + 10, 5 * row + 7]
    assert b.out_loc.tolist() == [100, 101, 102, 200]
    assert s.pool_cells.tolist() == [3 * row + 8, 3 * row + 9] and s.spec.row_start.tolist() == [0, 3]


@pytest.mark.parametrize("temperature,penalties", [(0.0, False), (1.0, False), (0.0, True), (1.0, True)])
def test_decode_rows_score_sample_and_keep_as_the_extend_step(qwen3_path, monkeypatch, temperature, penalties):
    from worker.config import EngineConfig
    from worker.engine import Engine

    engine = Engine(EngineConfig(str(qwen3_path), page_size=4, num_pages=64, max_running_reqs=8))
    as_rows, as_extend = _rows_against_extend(engine, monkeypatch, temperature, penalties)
    assert torch.equal(as_rows[0], as_extend[0]) and torch.equal(as_rows[3], as_extend[3])  # samples, counts
    torch.testing.assert_close(as_rows[1:3], as_extend[1:3], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,penalties", [(0.0, True), (1.0, True), (1.0, False)])
def test_on_gpu_replayed_decode_rows_sample_and_keep_as_the_extend_step(tmp_path, monkeypatch, temperature, penalties):
    """On the GPU the decode rows replay a CUDA graph; with penalties counting proposals the draw runs
    after it, eagerly. In bfloat16 the decode kernel and the extend step's prefill kernel round apart,
    so logprobs agree within bfloat16's step."""
    from tiny_checkpoints import build_qwen3_hd128

    from worker.config import EngineConfig
    from worker.engine import Engine

    path = build_qwen3_hd128(tmp_path / "qwen3_hd128")
    engine = Engine(EngineConfig(str(path), dtype="bfloat16", page_size=4, num_pages=64, max_running_reqs=8))
    assert engine.graphs is not None
    replayed = []
    replay = engine._replay
    monkeypatch.setattr(engine, "_replay", lambda *a: replayed.append(a[-1]) or replay(*a))
    as_rows, as_extend = _rows_against_extend(engine, monkeypatch, temperature, penalties)
    assert torch.equal(as_rows[0], as_extend[0]) and torch.equal(as_rows[3], as_extend[3])  # samples, counts
    torch.testing.assert_close(as_rows[1:3], as_extend[1:3], rtol=1e-4, atol=0.05)
    assert replayed and replayed[-1] == penalties  # the graph ran the rows; with penalties, counting


def _rows_against_extend(engine, monkeypatch, temperature: float, penalties: bool) -> tuple[tuple, tuple]:
    """A verify step (slot 0: three proposals, slot 2: one) run as decode rows and as an extend step,
    from the same token pool and processor counts: each run's (samples, logprobs, top logprobs,
    processor counts after), for the caller to compare."""
    import worker.engine as engine_module

    prompts = {0: [5, 9, 14, 5, 9, 14, 5, 9], 2: [7, 21, 33, 48, 60]}
    one = dict(
        temperature=np.full(2, temperature, np.float32),
        top_p=np.ones(2, np.float32),
        top_k=np.full(2, -1, np.int32),
        seeds=np.array([3, 4], np.int64),
    )
    # the prompts' KV at locations slot * 16 + position (pages of 4), their first samples in the pool
    lens = np.array([len(p) for p in prompts.values()], np.int32)
    locs = np.concatenate([s * 16 + np.arange(len(p)) for s, p in prompts.items()]).astype(np.int32)
    ids = np.concatenate(list(prompts.values())).astype(np.int32)
    slots = np.array(list(prompts), np.int32)
    engine.forward(BatchDesc(True, slots, lens, lens, locs, ids, **one)).done.synchronize()
    pool = engine.table.token_pool.clone()
    counts = engine.proc_state.counts.clone()

    def verify_of(drafts: list[list[int]], procs: ProcessorRows | None = None) -> BatchDesc:
        """Slot 0 verifies drafts[0] and slot 2 drafts[1] after their inputs (the samples in the pool)."""
        spec = np.array([len(d) for d in drafts], np.int32)
        ext = spec + 1
        return BatchDesc(
            True,
            slots,
            lens + ext,
            ext,
            np.concatenate([s * 16 + np.arange(n, n + e) for s, n, e in zip(slots, lens, ext)]).astype(np.int32),
            np.concatenate([[-1, *d] for d in drafts]).astype(np.int32),
            top_logprobs=2,
            spec_lens=spec,
            procs=procs,
            **one,
        )

    def run(desc: BatchDesc) -> tuple:
        engine.table.token_pool.copy_(pool)
        engine.proc_state.counts.copy_(counts)
        out = engine.forward(desc)
        out.done.synchronize()
        return out.next_tokens.clone(), out.logprobs.clone(), out.top_logprobs.clone(), engine.proc_state.counts.clone()

    verify = verify_of([[9, 14, 5], [33]])
    if penalties:
        # proposals of a token the model samples again right after it (found by trying tokens): without
        # penalties the draw repeats it; the penalties on the proposals before a sample (the only counts
        # there are) turn it away
        for token in range(engine.hf_config.vocab_size):
            drafts = [[token] * 3, [token]]
            plain = run(verify_of(drafts))[0]
            if token in plain[1:3].tolist():
                break
        procs = ProcessorRows.idle(2, engine.proc_state.scratch_row)
        procs.state_row[:] = slots
        procs.presence[:], procs.frequency[:], procs.repetition[:] = 2.0, 1.0, 1.5
        verify = verify_of(drafts, procs)

    ran = []
    monkeypatch.setattr(engine_module, "verify_as_decode", lambda *a: ran.append(verify_as_decode(*a)) or ran[-1])
    as_rows = run(verify)
    assert ran[-1] is not None and ran[-1].counts == penalties  # six samples, eight rows
    monkeypatch.setattr(engine_module, "verify_as_decode", lambda *a: None)
    as_extend = run(verify)
    if penalties:
        assert int(as_rows[3].sum()) > int(counts.sum())
        if temperature == 0:
            assert not torch.equal(as_extend[0], plain)  # the proposals' penalties changed a sample
    return as_rows, as_extend


def test_a_verify_step_asked_whether_it_replays_is_turned_into_decode_rows_once(qwen3_path, monkeypatch):
    """A tensor-parallel rank 0 asks replays(desc) before forward(desc): the step's decode rows are made
    once, and a step forward gets without that question (or another step) is converted afresh."""
    import worker.engine as engine_module
    from worker.config import EngineConfig
    from worker.engine import Engine

    engine = Engine(EngineConfig(str(qwen3_path), page_size=4, num_pages=64, max_running_reqs=8))
    made = []
    convert = engine_module.verify_as_decode
    monkeypatch.setattr(engine_module, "verify_as_decode", lambda *a: made.append(a[0]) or convert(*a))
    desc, other = verify_desc(), verify_desc(seeds=np.array([21, 22], np.int64))
    assert not engine.replays(desc)  # no graphs on the CPU
    engine.forward(desc).done.synchronize()
    assert made == [desc]
    engine.forward(desc).done.synchronize()  # not asked again: converted again
    engine.replays(desc)
    engine.forward(other).done.synchronize()  # asked of another step
    assert [d is desc for d in made] == [True, True, True, False]
