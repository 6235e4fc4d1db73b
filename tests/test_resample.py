"""The redraw of a replayed decode step over the rows that need it (worker/sampling/resample.py): the head's
plain draw of every row, then those rows drawn again alone over their processed and filtered logits,
gives the tokens, token-pool cells and processor counts that the step sampler gives over the whole
batch at once (what a bucket's variant graph and an eager step compute). Which rows are redrawn, and
when the variant runs instead, follows the batch's size and share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.sampling import resample
from worker.sampling.processors import ProcessorInit, ProcessorState
from worker.sampling.step_sampler import SampleArgs, StepSampler
from worker.staging import PinnedStaging, upload_record

VOCAB, SLOTS, SPARSE = 97, 64, 8


def _batch(n: int, seed: int, *, filters: bool, procs: bool, grammar: bool):
    """A step of n rows where every third row filters or processes (and every fifth is constrained):
    its per-row host arrays, and a processor state whose slots hold counts, prompts and biases."""
    rng = np.random.default_rng(seed)
    state = ProcessorState(SLOTS, VOCAB, SPARSE, torch.device("cpu"))
    slots = rng.permutation(SLOTS)[:n]
    special = np.arange(n) % 3 == 0
    rows = {}
    if filters:
        rows["top_k"] = np.where(special & (np.arange(n) % 2 == 0), 5, -1).astype(np.int32)
        rows["top_p"] = np.where(special & (np.arange(n) % 2 == 1), 0.7, 1.0).astype(np.float32)
        rows["min_p"] = np.where(special, 0.02, 0.0).astype(np.float32)
    if procs:
        rows["state_row"] = np.where(special, slots, state.scratch_row).astype(np.int64)
        rows["presence"] = np.where(special, 0.5, 0.0).astype(np.float32)
        rows["frequency"] = np.where(special, 0.3, 0.0).astype(np.float32)
        rows["repetition"] = np.where(special, 1.4, 1.0).astype(np.float32)
        rows["ban_stop"] = special.astype(bool)
        inits = [
            ProcessorInit(
                int(s),
                rng.integers(0, VOCAB, 6).astype(np.int32),
                rng.integers(0, VOCAB, 9).astype(np.int32),
                np.array([3, 11, 2], dtype=np.int32),
                np.array([2.0, -1.5, 0.0], dtype=np.float32),
                np.array([0, 0, 1], dtype=np.uint8),
            )
            for s in slots[special]
        ]
        state.apply_init(_on_torch(state.init_arrays(inits)))
    grammar_rows = np.flatnonzero(np.arange(n) % 5 == 0).astype(np.int32) if grammar else None
    grammar_mask = (
        rng.integers(-(2**31), 2**31, size=(len(grammar_rows), -(-VOCAB // 32)), dtype=np.int64).astype(np.int32)
        if grammar
        else None
    )
    temperature = np.where(np.arange(n) % 4 == 0, 0.0, 0.8).astype(np.float32)
    return (
        state,
        rows,
        grammar_rows,
        grammar_mask,
        temperature,
        rng.integers(0, 2**40, n),
        rng.integers(10, 90, n),
        torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)),
    )


def _on_torch(record):
    """`record` with its arrays staged (on the CPU: tensors over the staging buffer)."""
    upload_record(PinnedStaging(torch.device("cpu")), record)
    return record


def _args(n, rows, temperature, seeds, positions, token_write, allowed) -> SampleArgs:
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rows.items()}
    return SampleArgs.of(
        {**t, "temperature": torch.from_numpy(temperature), "seeds": torch.from_numpy(seeds)},
        torch.from_numpy(positions),
        torch.from_numpy(token_write),
        allowed,
    )


@pytest.mark.parametrize(
    "filters,procs,grammar", [(True, False, False), (False, True, False), (False, True, True), (True, True, True)]
)
def test_redrawing_the_rows_that_need_it_equals_sampling_the_whole_batch(filters, procs, grammar):
    n = 48
    state, rows, grammar_rows, grammar_mask, temperature, seeds, positions, logits = _batch(
        n, 3, filters=filters, procs=procs, grammar=grammar
    )
    token_write = np.arange(n, dtype=np.int64) * 3 + 1
    allowed = None
    if grammar:
        allowed = torch.full((n, grammar_mask.shape[1]), -1, dtype=torch.int32)
        allowed[torch.from_numpy(grammar_rows).long()] = torch.from_numpy(grammar_mask)

    ref_state = ProcessorState(SLOTS, VOCAB, SPARSE, torch.device("cpu"))
    for name in ("counts", "prompt_seen", "sparse_ids", "sparse_bias", "sparse_ban"):
        getattr(ref_state, name).copy_(getattr(state, name))
    ref_pool = torch.zeros(3 * n + 2, dtype=torch.int32)
    ref = StepSampler(ref_pool, ref_state)(
        logits,
        _args(n, rows, temperature, seeds, positions, token_write, allowed),
        procs=procs or grammar,
        filtered=filters,
    )

    pool = torch.zeros(3 * n + 2, dtype=torch.int32)
    sampler = StepSampler(pool, state)
    head = sampler(logits, _args(n, {}, temperature, seeds, positions, token_write, None), procs=False, filtered=False)
    picked = resample.rows_to_redraw(n, rows, state.scratch_row, grammar_rows)
    assert picked is not None and list(picked) == [i for i in range(n) if i % 3 == 0 or (grammar and i % 5 == 0)]
    staged = _on_torch(
        resample.redraw_inputs(
            picked, {**rows, "temperature": temperature, "seeds": seeds}, positions, token_write, grammar_rows
        )
    )
    got = resample.redraw(
        sampler,
        logits,
        head.clone(),
        staged,
        torch.from_numpy(grammar_mask) if grammar else None,
        procs=procs or grammar,
        filtered=filters,
    )
    assert torch.equal(got, ref)
    assert torch.equal(pool, ref_pool)
    assert torch.equal(state.counts, ref_state.counts)
    if grammar:  # every constrained row drew an allowed token
        for i, row in enumerate(grammar_rows):
            tok = int(got[row])
            assert grammar_mask[i, tok // 32] >> (tok % 32) & 1


def test_the_variant_runs_for_small_batches_and_for_batches_most_of_whose_rows_need_it():
    scratch = SLOTS
    some = {"min_p": np.where(np.arange(64) < 10, 0.1, 0.0).astype(np.float32)}
    assert list(resample.rows_to_redraw(64, some, scratch, None)) == list(range(10))
    assert resample.rows_to_redraw(resample.COMPACT_MIN_BATCH - 1, {"min_p": some["min_p"][:31]}, scratch, None) is None
    most = {"min_p": np.where(np.arange(64) < 40, 0.1, 0.0).astype(np.float32)}
    assert resample.rows_to_redraw(64, most, scratch, None) is None
    procs_only_on_scratch = {"state_row": np.full(64, scratch, dtype=np.int64)}
    assert list(resample.rows_to_redraw(64, procs_only_on_scratch, scratch, np.array([7, 30], dtype=np.int32))) == [
        7,
        30,
    ]
