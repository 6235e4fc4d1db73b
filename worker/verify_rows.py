"""A verify step (speculative decoding) run as a decode step of one row per sample, so that it replays a
decode CUDA graph instead of running an extend step eagerly.

A row that verifies s proposals computes s + 1 tokens (its input, then the proposals) and samples after
each. Its sample j is a decode row of its own: the row's slot, the length up to and including token j,
that token's KV location, and the row's sampling columns. Within a layer every token's KV is written
before any row attends, so sample j's row sees the row's tokens up to j and no further: the causal
mask of the extend step. The proposals are written into the token pool first, at their positions,
where a decode row reads its input; each row's sample then overwrites the cell after its input (the
next row's proposal, already read), which leaves the pool holding the samples the request keeps.

Rows whose penalties count the proposals before each sample (processor state in use) run as decode
rows too, with the step's (sample, proposal) pairs (`DecodeVerify.counts`): their samples are then
drawn eagerly after the forward (a replayed graph's own draw knows no pairs), with each sample's
proposals before it counted and only the kept samples counted into the state afterwards, as the
extend step draws them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from worker.batch import BatchDesc
from worker.sampling.processors import ProcessorRows
from worker.sampling.verify import SpecRows, spec_rows


@dataclass
class DecodeVerify:
    """A verify step as decode rows: the decode description, where its samples fall among the verify
    rows (for the count each keeps), and the token-pool cells its proposals fill before it runs."""

    desc: BatchDesc
    spec: SpecRows
    pool_cells: np.ndarray  # int64 [P]
    pool_tokens: np.ndarray  # int32 [P]
    # some row's processors count into its slot's state: its samples need the (sample, proposal) pairs
    # (spec.proposed_at, proposed_token) and the kept-sample count, drawn eagerly
    counts: bool = False


def verify_as_decode(desc: BatchDesc, scratch_row: int, pool_row: int, max_rows: int) -> DecodeVerify | None:
    """`desc`, a verify step, as decode rows; None where it must run as an extend step: it scores
    prompt logprobs, it has rows that do not verify (prompt chunks), or its samples are more than
    `max_rows`."""
    if desc.spec_lens is None or desc.plp_idx is not None:
        return None
    n = desc.spec_lens.astype(np.int64) + 1
    if int(n.sum()) > max_rows or not np.array_equal(n, desc.extend_lens):
        return None
    counts = desc.procs is not None and bool((desc.procs.state_row != scratch_row).any())
    ends = np.cumsum(desc.extend_lens.astype(np.int64))
    spec = spec_rows(desc.spec_lens, desc.seq_lens, ends, desc.input_ids, pairs=counts)
    rows = spec.rows
    slots = desc.slots[rows]
    # every token is sampled after, so sample i is token i of the step (its out_loc too)
    given = desc.input_ids >= 0
    cells = slots.astype(np.int64) * pool_row + spec.sample_pos - 1
    decode = replace(
        desc,
        is_prefill=False,
        slots=slots,
        seq_lens=spec.sample_pos.astype(np.int32),
        extend_lens=np.ones(len(rows), dtype=np.int32),
        input_ids=None,
        temperature=desc.temperature[rows],
        top_p=desc.top_p[rows],
        top_k=desc.top_k[rows],
        seeds=desc.seeds[rows],
        min_p=desc.min_p[rows] if desc.min_p is not None else None,
        procs=_rows_of(desc.procs, rows) if desc.procs is not None else None,
        spec_lens=None,
    )
    return DecodeVerify(decode, spec, cells[given], desc.input_ids[given].astype(np.int32), counts)


def _rows_of(procs: ProcessorRows, rows: np.ndarray) -> ProcessorRows:
    return ProcessorRows(**{name: getattr(procs, name)[rows] for name in procs.__dataclass_fields__})
