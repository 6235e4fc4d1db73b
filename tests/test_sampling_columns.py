"""The per-row sampling columns, declared once (worker/sampling/columns.py): every column travels in
the packed description and comes back as it was, with its group present or absent; the graphs' blocks
(worker/graph_io.py) hold each column once, read back what was packed and pad as a row that uses
nothing; a variant's arguments carry exactly its groups' columns; the staged records keep their shapes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from worker.batch import BatchDesc, desc_columns, desc_layout, pack_desc, packed_nbytes, unpack_desc
from worker.cuda_graph import VARIANTS, _Bucket
from worker.graph_io import IO, SAMPLER_IO, io_pads, sampler_io_pads
from worker.sampling.columns import COLUMNS, DRAW, FILTER, MIN_P, PROCS, column_pads, columns_of
from worker.sampling.inputs import stage_sampling, step_groups
from worker.sampling.processors import ProcessorInit, ProcessorRows, ProcessorState
from worker.sampling.resample import redraw
from worker.sampling.step_sampler import SampleArgs, StepSampler
from worker.staging import PinnedStaging, upload_record

SCRATCH = 64
NAMES = [c.name for c in COLUMNS]


def _desc(rng: np.random.Generator, n: int, *, min_p: bool, procs: bool, inits: int = 0) -> BatchDesc:
    values = {
        c.name: rng.integers(-3, 100, n).astype(c.dtype) if not c.is_float else rng.uniform(0, 1, n).astype(c.dtype)
        for c in COLUMNS
    }
    values["seeds"] = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    draw_filter = {c.name: values[c.name] for c in columns_of(DRAW, FILTER)}
    return BatchDesc(
        False,
        slots=rng.permutation(SCRATCH)[:n].astype(np.int32),
        seq_lens=rng.integers(1, 99, n).astype(np.int32),
        extend_lens=np.ones(n, np.int32),
        out_loc=rng.integers(0, 1 << 20, n).astype(np.int32),
        input_ids=None,
        **draw_filter,
        min_p=values["min_p"] if min_p else None,
        procs=ProcessorRows(**{c.name: values[c.name] for c in columns_of(PROCS)}) if procs else None,
        proc_init=[
            ProcessorInit(
                i,
                rng.integers(0, 99, 3).astype(np.int32),
                rng.integers(0, 99, 2).astype(np.int32),
                np.array([4, 7], np.int32),
                np.array([1.5, 0.0], np.float32),
                np.array([0, 1], np.uint8),
            )
            for i in range(inits)
        ],
    )


@pytest.mark.parametrize("min_p,procs", [(False, False), (True, False), (False, True), (True, True)])
def test_every_column_packs_and_unpacks_as_it_was(min_p, procs):
    desc = _desc(np.random.default_rng(1), 7, min_p=min_p, procs=procs, inits=2)
    layout = desc_layout(desc)
    payload = np.zeros(packed_nbytes(layout), dtype=np.uint8)
    pack_desc(desc, layout, payload)
    got = unpack_desc(layout, payload)
    want = desc_columns(desc)
    assert set(want) == {c.name for c in COLUMNS if (c.group != MIN_P or min_p) and (c.group != PROCS or procs)}
    for name, values in desc_columns(got).items():
        assert values.dtype == want[name].dtype and np.array_equal(values, want[name]), name
    assert set(desc_columns(got)) == set(want)
    assert (got.min_p is None) == (not min_p) and (got.procs is None) == (not procs)
    assert [x.slot for x in got.proc_init] == [0, 1]


def test_the_description_and_the_sampler_name_every_column():
    procs = [f.name for f in dataclasses.fields(ProcessorRows)]
    assert procs == [c.name for c in columns_of(PROCS)]
    desc_fields = {f.name for f in dataclasses.fields(BatchDesc)}
    assert {c.name for c in COLUMNS if c.group != PROCS} <= desc_fields
    args = [f.name for f in dataclasses.fields(SampleArgs)]
    assert args == ["positions", "token_write", "allowed", *NAMES, "proposed", "verify"]


def test_the_graph_blocks_hold_every_column_once_as_int64_or_float32_rows():
    names = IO.ints + IO.floats + SAMPLER_IO.ints + SAMPLER_IO.floats
    assert sorted(n for n in names if n in NAMES) == sorted(NAMES)
    assert len(set(names)) == len(names)
    for c in COLUMNS:
        block = IO if c.group == DRAW else SAMPLER_IO
        assert c.name in (block.floats if c.is_float else block.ints)


@pytest.mark.parametrize("bs,n", [(1, 1), (8, 3), (16, 16)])
def test_the_sampler_block_reads_back_what_was_packed_and_pads_past_the_real_rows(bs, n):
    rng = np.random.default_rng(bs)
    pads = sampler_io_pads(SCRATCH)
    values = {name: rng.integers(0, SCRATCH, n) for name in SAMPLER_IO.ints}
    values.update({name: rng.uniform(0, 1, n).astype(np.float32) for name in SAMPLER_IO.floats})
    del values["presence"]  # a name the step lacks holds its pad in the real rows too
    views = SAMPLER_IO.views(torch.from_numpy(SAMPLER_IO.pack(bs, n, values, pads)), bs)
    for name, view in views.items():
        assert view.dtype == (torch.float32 if name in SAMPLER_IO.floats else torch.int64)
        real = values[name] if name in values else np.full(n, pads[name])
        assert view[:n].tolist() == pytest.approx(real.tolist()), name
        assert view[n:].tolist() == [pads[name]] * (bs - n), name


def test_padded_rows_are_greedy_write_to_the_scratch_cells_and_use_no_filter_or_processor():
    assert dict(sampler_io_pads(SCRATCH)) == {
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "state_row": SCRATCH,
        "presence": 0.0,
        "frequency": 0.0,
        "repetition": 1.0,
        "ban_stop": 0,
    }
    assert io_pads(999, 555) == {
        "token_read": 0,
        "positions": 0,
        "out_loc": 999,
        "token_write": 555,
        "sample_pos": 0,
        "temperature": 0.0,
        "seeds": 0,
    }
    views = IO.views(torch.from_numpy(IO.pack(4, 0, {}, io_pads(999, 555))), 4)
    assert views["out_loc"].tolist() == [999] * 4 and views["temperature"].tolist() == [0.0] * 4
    assert column_pads(SCRATCH)["state_row"] == SCRATCH


@pytest.mark.parametrize("procs,filtered", [(False, False), *VARIANTS])
def test_a_bucket_gives_each_graph_the_columns_of_its_groups(procs, filtered):
    bs = 4
    b = _Bucket(torch.zeros(IO.nbytes(bs), dtype=torch.uint8), bs)
    b.bind_sampler_io(torch.zeros(SAMPLER_IO.nbytes(bs), dtype=torch.uint8))
    b.allowed = torch.full((bs, 2), -1, dtype=torch.int32)
    a = b.args(procs, filtered)
    groups = (
        {DRAW}
        | ({FILTER} if filtered else set())
        | ({MIN_P} if procs or filtered else set())
        | ({PROCS} if procs else set())
    )
    for c in COLUMNS:
        assert (getattr(a, c.name) is not None) == (c.group in groups), c.name
    assert (a.allowed is not None) == procs
    if procs:
        assert a.ban_stop.dtype == torch.bool and a.state_row.dtype == torch.int64
    assert a.positions is b.sample_pos and a.token_write is b.token_write


def test_an_eager_step_stages_the_columns_of_the_groups_it_uses_as_the_sampler_reads_them():
    rng = np.random.default_rng(3)
    desc = _desc(rng, 5, min_p=True, procs=True, inits=1)
    desc.temperature[:] = [0.0, 0.5, 0.0, 1.0, 0.7]
    desc.top_k[:], desc.top_p[:] = -1, 1.0
    desc.min_p[:] = [0, 0, 0.1, 0, 0]
    desc.grammar_rows, desc.grammar_mask = np.array([1, 3], np.int32), rng.integers(0, 9, (2, 3)).astype(np.int32)
    state = ProcessorState(SCRATCH, 50, 4, torch.device("cpu"))
    host = stage_sampling(
        desc, desc_columns(desc), 0, desc.seq_lens.astype(np.int64), np.arange(5, dtype=np.int64), state
    )
    assert host.groups == {DRAW, MIN_P, PROCS}
    assert set(host.columns) == {c.name for c in columns_of(DRAW, MIN_P, PROCS)}
    for c in columns_of(DRAW, MIN_P, PROCS):
        assert host.columns[c.name].dtype == c.staged
    staged = upload_record(PinnedStaging(torch.device("cpu")), host)
    dev = host  # its arrays are the device views now
    assert dev.grammar_mask.shape == (2, 3) and dev.grammar_mask.tolist() == desc.grammar_mask.tolist()
    assert dev.columns["ban_stop"].dtype == torch.bool and dev.init.slots.tolist() == [0]
    args = dev.args(torch.zeros(5, dtype=torch.int32), 5)
    assert args.top_k is None and args.min_p is not None and args.allowed.shape == (5, 3)
    assert args.allowed[0].tolist() == [-1] * 3 and args.allowed[3].tolist() == desc.grammar_mask[1].tolist()
    staged.release()


def test_an_all_greedy_step_stages_no_draw_and_judges_no_filter():
    desc = _desc(np.random.default_rng(4), 3, min_p=True, procs=False)
    desc.temperature[:] = 0
    desc.top_k[:] = 5
    assert step_groups(desc_columns(desc), False, SCRATCH) == frozenset()
    assert step_groups(desc_columns(desc), True, SCRATCH) == {PROCS}


@pytest.mark.parametrize("n,bs", [(6, 8), (40, 48)], ids=["variant-graph", "redraw"])
def test_a_replayed_step_samples_what_the_eager_step_samples(n, bs):
    """The graph path's arguments, on the CPU without the graphs: the head over the per-step block's
    views, then the variant over the sampler block's (or the rows redrawn alone), give the eager
    step's tokens, token-pool cells and processor counts."""
    vocab, rng = 97, np.random.default_rng(n)
    desc = _desc(rng, n, min_p=True, procs=True)
    special = np.arange(n) % 7 == 1
    desc.temperature[:] = np.where(np.arange(n) % 3 == 0, 0.0, 0.8)
    desc.top_k[:], desc.top_p[:] = np.where(special, 5, -1), np.where(special, 0.8, 1.0)
    desc.min_p[:] = np.where(special, 0.05, 0.0)
    p = desc.procs
    p.state_row[:] = np.where(special, np.arange(n), SCRATCH)
    p.presence[:], p.frequency[:], p.repetition[:] = np.where(special, 0.5, 0), np.where(special, 0.3, 0), 1.0
    p.ban_stop[:] = 0
    seq, token_write = desc.seq_lens.astype(np.int64), np.arange(n, dtype=np.int64) * 2
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(n))
    counts = torch.randint(0, 3, (SCRATCH + 1, vocab), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    counts[SCRATCH] = 0

    def sampler():
        state = ProcessorState(SCRATCH, vocab, 4, torch.device("cpu"))
        state.counts.copy_(counts)
        return StepSampler(torch.zeros(2 * bs + 1, dtype=torch.int32), state)

    eager_sampler, staging = sampler(), PinnedStaging(torch.device("cpu"), depth=4)
    e = stage_sampling(desc, desc_columns(desc), 0, seq, token_write, eager_sampler.state)
    upload_record(staging, e)
    want = eager_sampler(logits[:n], e.args(torch.from_numpy(seq), n), procs=e.procs, filtered=e.filtered)

    graph_sampler = sampler()
    g = stage_sampling(desc, desc_columns(desc), bs, seq, token_write, graph_sampler.state)
    upload_record(staging, g)
    assert g.groups == {DRAW, FILTER, MIN_P, PROCS} and (g.redraw is not None) == (n >= 32)
    io = IO.pack(
        bs,
        n,
        {
            "token_read": seq - 1,
            "positions": seq - 1,
            "out_loc": seq,
            "token_write": token_write,
            "sample_pos": seq,
            **desc_columns(desc),
        },
        io_pads(0, 2 * bs),
    )
    b = _Bucket(torch.from_numpy(io), bs)
    sio = torch.zeros(SAMPLER_IO.nbytes(bs), dtype=torch.uint8)
    b.bind_sampler_io(sio)
    b.allowed = torch.full((bs, 4), -1, dtype=torch.int32)
    head = graph_sampler(logits, b.args(False, False), procs=False, filtered=False)
    if g.redraw is not None:
        got = redraw(graph_sampler, logits, head, g.redraw, None, procs=g.procs, filtered=g.filtered)
    else:
        sio.copy_(g.sampler_io)
        procs = g.procs or g.any_min_p  # the variant the engine replays
        got = graph_sampler(logits, b.args(procs, g.filtered), procs=procs, filtered=g.filtered)
    assert torch.equal(got[:n], want)
    assert torch.equal(graph_sampler.flat_pool[:-1], eager_sampler.flat_pool[:-1])
    assert torch.equal(graph_sampler.state.counts, eager_sampler.state.counts)
