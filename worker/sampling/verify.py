"""Verifying proposed tokens (speculative decoding) in one extend step: where each row samples, and
which of its samples it keeps. (The engine runs such a step as decode rows, one a sample, where it can:
worker/verify_rows.py.)

A row with s proposals d_1..d_s computes s + 1 positions (its input, then the proposals) and samples
at each: t_0..t_s, the target's own draws at those positions (the argmax, or the Gumbel-max draw keyed
by (seed, position): worker/sampling/sampler.py). It keeps t_0..t_a, a being the longest prefix with
d_{j+1} == t_j: the accepted proposals and then the target's token at the first mismatch (or the
bonus token after the last proposal).

For a proposer whose distribution q is one-hot (n-gram), this is rejection sampling exactly: the
proposal x is accepted with probability p(x) (the chance that the target's draw is x), and on
rejection the draw, conditioned on not being x, is distributed as p with x removed, renormalized,
which is norm(max(0, p - q)). Greedy rows accept the proposals equal to the argmax. Because the draw
at a position is the one that decoding without speculation makes there, every kept token is the
token decoding without speculation would have produced: outputs are the same, token for token, for
greedy and seeded sampled rows alike (up to the float rounding of an extend step against a decode step),
whatever the proposer. That leaves a draft model free to propose its own draw under the same noise
(cluster/scheduler/draft.py): a draft whose distribution is close to the target's then proposes the
target's draw as often as the two distributions' Gumbel-max draws coincide, at any temperature."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SpecRows:
    """Host arrays ([S], S = sum(spec_lens + 1)) of an extend step's samples, row by row."""

    rows: np.ndarray  # int64: the batch row of each sample
    last_idx: np.ndarray  # int64: the step's token whose hidden state it samples from
    sample_pos: np.ndarray  # int64: the position of the sampled token (its draw's key with the seed)
    drafts: np.ndarray  # int32: the proposal the sample must equal to keep the next one; -1 after the last
    row_start: np.ndarray  # int64 [B]: each row's first sample
    # (sample, token) pairs [P]: each proposal before a sample in its row (what its penalties count)
    proposed_at: np.ndarray
    proposed_token: np.ndarray


def spec_rows(
    spec_lens: np.ndarray, seq_lens: np.ndarray, ends: np.ndarray, input_ids: np.ndarray, pairs: bool = True
) -> SpecRows:
    """Where each row samples: its last spec_len + 1 tokens (`ends`: cumulative extend lengths;
    `seq_lens`: lengths once the step is done; `input_ids`: the step's tokens, proposals included).
    `pairs`: False leaves proposed_at and proposed_token empty (a step whose penalties count nothing)."""
    n = spec_lens.astype(np.int64) + 1
    rows = np.repeat(np.arange(len(n)), n)
    row_start = np.cumsum(n) - n
    j = np.arange(int(n.sum())) - row_start[rows]  # the sample's place in its row
    back = n[rows] - 1 - j  # how many of the row's tokens come after the one sampled from
    last_idx = ends.astype(np.int64)[rows] - 1 - back
    drafts = np.full(len(rows), -1, dtype=np.int32)
    has_next = back > 0
    drafts[has_next] = input_ids[last_idx[has_next] + 1]
    if not pairs:
        none = np.zeros(0, dtype=np.int64)
        return SpecRows(rows, last_idx, seq_lens.astype(np.int64)[rows] - back, drafts, row_start, none, none)
    # the sample at row_start + j follows the proposals that drafts holds at row_start + i, i < j: the
    # pairs (j, i) below the diagonal, those within each row's samples
    j, i = np.tril_indices(int(n.max()), -1)
    within = j[None, :] < n[:, None]  # [B, pairs]
    starts = np.broadcast_to(row_start[:, None], within.shape)[within]
    proposed_at = starts + np.broadcast_to(j, within.shape)[within]
    proposed_token = drafts[starts + np.broadcast_to(i, within.shape)[within]].astype(np.int64)
    return SpecRows(
        rows, last_idx, seq_lens.astype(np.int64)[rows] - back, drafts, row_start, proposed_at, proposed_token
    )


def kept_counts(tokens: list[int], spec_lens: list[int], input_ids: np.ndarray) -> list[int]:
    """How many samples each row keeps (what `accepted` counts on the device), on the host from the
    step's samples (`tokens`, row after row) and its tokens (`input_ids`: each row's input, then its
    proposals): the scheduler learns it with the tokens, and no step waits on a count of its own."""
    counts, first, end = [], 0, 0
    for s in spec_lens:
        end += s + 1
        proposals = input_ids[end - s : end]
        kept = 1
        while kept <= s and tokens[first + kept - 1] == proposals[kept - 1]:
            kept += 1
        counts.append(kept)
        first += s + 1
    return counts


def kept_samples(
    tokens: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor, row_start: torch.Tensor
) -> torch.Tensor:
    """bool [S]: the samples their rows keep, on the device: each row's up to and including its first
    sample that differs from the proposal after it."""
    mismatch = (tokens.to(torch.int32) != drafts).to(torch.int32)
    before = mismatch.cumsum(0) - mismatch  # mismatches before each sample, over the whole step
    return (before - before[row_start][rows]) == 0


def accepted(tokens: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """int32 [B]: how many samples each row keeps (kept_samples), on the device."""
    kept = kept_samples(tokens, drafts, rows, row_start)
    counts = torch.zeros(len(row_start), dtype=torch.int32, device=tokens.device)
    return counts.index_add_(0, rows, kept.to(torch.int32))
