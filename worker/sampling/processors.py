"""Logits processors whose state lives on the device, per request slot: penalties over the tokens a
request has generated (OpenAI's presence and frequency penalties) or seen (Hugging Face's repetition
penalty, over prompt and output), logit biases, and min_tokens' ban on stop tokens.

The state is updated from the sampled ids on the device, in the same graph as sampling, so step N+1
applies step N's token without the host ever knowing it: the overlap loop keeps running. A step whose
requests use none of these never touches the state (the engine picks a graph without it).

Per slot (one row more than there are request slots: the scratch row, all zeros, that rows without
processors read and that no update writes):
- `counts` int32 [slots + 1, vocab]: how often the slot's request generated each token;
- `prompt_seen` bool [slots + 1, vocab]: the tokens of its prompt (for the repetition penalty);
- `sparse_ids`, `sparse_bias`, `sparse_ban` [slots + 1, K]: its logit biases, then its stop ids, which
  are banned (-inf) while the step's row says min_tokens is not reached. Unused entries add 0 to token 0.

The order is vLLM's: biases and the ban first, then the repetition penalty, then frequency and presence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from worker.sampling.columns import PROCS, column_pads, columns_of

A = TypeVar("A")  # np.ndarray on the host, torch.Tensor once staged


@dataclass
class ProcessorRows:
    """A step's per-row processor arguments ([B] each), present when some row uses processors: the
    procs group's columns (worker/sampling/columns.py)."""

    state_row: np.ndarray  # int32: the slot whose state the row reads and updates; the scratch row if none
    presence: np.ndarray  # float32
    frequency: np.ndarray  # float32
    repetition: np.ndarray  # float32; 1 is off
    ban_stop: np.ndarray  # uint8: 1 while the row's min_tokens is not reached (its stop ids are banned)

    @classmethod
    def idle(cls, n: int, scratch_row: int) -> ProcessorRows:
        """`n` rows that use no processors: every column at its pad."""
        pads = column_pads(scratch_row)
        return cls(**{c.name: np.full(n, pads[c.name], dtype=c.dtype) for c in columns_of(PROCS)})


@dataclass
class ProcessorInit:
    """A slot's state set afresh (a request's prefill begins, first or after a preemption)."""

    slot: int
    prompt_ids: np.ndarray  # int32: the prompt (the repetition penalty sees them; empty when unused)
    output_ids: np.ndarray  # int32: tokens generated so far (after a preemption)
    sparse_ids: np.ndarray  # int32: biased token ids, then stop ids
    sparse_bias: np.ndarray  # float32: their biases (0 for the stop ids)
    sparse_ban: np.ndarray  # uint8: 1 for the stop ids


@dataclass
class ProcessorInitArrays(Generic[A]):
    """The flat writes that set a step's ProcessorInit slots afresh: numpy arrays on the host, their
    staged device twins after the upload."""

    slots: A  # int64: the slots reset
    prompt: A  # int64: cells of `prompt_seen` set (slot * vocab + token)
    output: A  # int64: cells of `counts` incremented
    sparse_at: A  # int64: cells of the sparse entries written ...
    sparse_ids: A  # int64 ... with these ids,
    sparse_bias: A  # float32  biases
    sparse_ban: A  # bool     and bans


class ProcessorState:
    def __init__(self, num_slots: int, vocab: int, max_sparse: int, device: torch.device) -> None:
        self.vocab, self.max_sparse = vocab, max_sparse
        self.scratch_row = num_slots
        rows = num_slots + 1
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.sparse_ids = torch.zeros(rows, max_sparse, dtype=torch.int64, device=device)
        self.sparse_bias = torch.zeros(rows, max_sparse, dtype=torch.float32, device=device)
        self.sparse_ban = torch.zeros(rows, max_sparse, dtype=torch.bool, device=device)

    def init_arrays(self, inits: list[ProcessorInit]) -> ProcessorInitArrays[np.ndarray]:
        """The flat indices and values that `apply_init` writes, computed on the host (staged as one copy)."""
        slots = np.fromiter((x.slot for x in inits), dtype=np.int64, count=len(inits))
        prompt = [x.slot * self.vocab + x.prompt_ids.astype(np.int64) for x in inits]
        output = [x.slot * self.vocab + x.output_ids.astype(np.int64) for x in inits]
        sparse = [x.slot * self.max_sparse + np.arange(len(x.sparse_ids), dtype=np.int64) for x in inits]
        cat = np.concatenate
        return ProcessorInitArrays(
            slots=slots,
            prompt=cat(prompt),
            output=cat(output),
            sparse_at=cat(sparse),
            sparse_ids=cat([x.sparse_ids for x in inits]).astype(np.int64),
            sparse_bias=cat([x.sparse_bias for x in inits]).astype(np.float32),
            sparse_ban=cat([x.sparse_ban for x in inits]).astype(bool),
        )

    def apply_init(self, a: ProcessorInitArrays[torch.Tensor]) -> None:
        """Resets the slots of `a.slots` and writes their prompt, output and sparse entries (the device
        twins of `init_arrays`), on the current stream."""
        for t in (self.counts, self.prompt_seen, self.sparse_ids, self.sparse_bias, self.sparse_ban):
            t.index_fill_(0, a.slots, 0)
        self.prompt_seen.view(-1).index_fill_(0, a.prompt, True)
        self.counts.view(-1).index_add_(0, a.output, torch.ones_like(a.output, dtype=torch.int32))
        self.sparse_ids.view(-1).index_copy_(0, a.sparse_at, a.sparse_ids)
        self.sparse_bias.view(-1).index_copy_(0, a.sparse_at, a.sparse_bias)
        self.sparse_ban.view(-1).index_copy_(0, a.sparse_at, a.sparse_ban)

    def apply(
        self,
        logits: torch.Tensor,
        state_row: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        repetition: torch.Tensor,
        ban_stop: torch.Tensor,
        proposed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """float32 logits [B, vocab] with every row's processors applied. A row on the scratch row with
        zero penalties and repetition 1 comes back exactly as it was. `proposed` (a verify step: rows
        are samples, several of one slot): (sample, token) pairs, each a proposal before that sample
        in its row, counted as generated there."""
        rows = state_row.long()
        x = logits.float().clone()
        ban = self.sparse_ban[rows] & ban_stop.bool().unsqueeze(1)
        add = self.sparse_bias[rows].masked_fill(ban, float("-inf"))
        x.scatter_add_(1, self.sparse_ids[rows], add)
        counts = self.counts[rows]
        if proposed is not None and proposed[0].numel():
            at, tokens = proposed
            counts.index_put_((at, tokens.long()), torch.ones_like(at, dtype=counts.dtype), accumulate=True)
        generated = counts > 0
        rep = repetition.unsqueeze(1)
        x = torch.where(generated | self.prompt_seen[rows], torch.where(x > 0, x / rep, x * rep), x)
        return x - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * generated

    def update(self, state_row: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Counts each row's sampled token in its slot (rows on the scratch row count nothing; with `kept`,
        a verify step's, only the samples it keeps)."""
        rows = state_row.long()
        counted = rows != self.scratch_row
        if kept is not None:
            counted &= kept
        self.counts.view(-1).index_add_(0, rows * self.vocab + tokens.long(), counted.int())
