"""A step's sampling on the device, the same in an eager step and in a captured graph: the logits
processors (processors.py) when some row uses them, the top-k/top-p/min-p filter when some row
filters, then the draw of sampler.py; the sampled tokens go into the token pool (where the next
step reads its input) and, with processors, into the request slots' counts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from worker import triton_ops
from worker.kernels import Kernels
from worker.sampling.columns import COLUMNS
from worker.sampling.processors import ProcessorState
from worker.sampling.sampler import apply_min_p, filter_logits, sample_unfiltered
from worker.sampling.verify import kept_samples


@dataclass(kw_only=True)
class SampleArgs:
    """Per-row device tensors ([B]) of one step's sampling: where each row's token goes and what it
    samples, then one field per column (worker/sampling/columns.py), None for a group the step leaves
    out. Build it with `of`."""

    positions: torch.Tensor  # the position each row samples (its key with the seed)
    token_write: torch.Tensor  # int64: the token-pool cell of each row's sampled token
    allowed: torch.Tensor | None = None  # int32 [B, W]: grammars' allowed tokens, one bit each (-1: all)
    temperature: torch.Tensor | None = None  # draw (None: every row greedy)
    seeds: torch.Tensor | None = None
    top_p: torch.Tensor | None = None  # filter (a sort)
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None  # min_p (no sort)
    state_row: torch.Tensor | None = None  # procs
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    ban_stop: torch.Tensor | None = None
    # a verify step (rows are samples): the proposals before each sample, as (sample, token) pairs, for
    # its penalties; and (drafts, rows, row_start) of worker/sampling/verify.py, to count kept samples only
    proposed: tuple[torch.Tensor, torch.Tensor] | None = None
    verify: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        columns: Mapping[str, torch.Tensor],
        positions: torch.Tensor,
        token_write: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> SampleArgs:
        """The arguments of the columns given (by name); those not given are None."""
        return cls(
            positions=positions,
            token_write=token_write,
            allowed=allowed,
            **{c.name: columns.get(c.name) for c in COLUMNS},
        )


def apply_bitmask(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """x [B, V] with the tokens whose bit is clear in `allowed` [B, ceil(V / 32)] (xgrammar's layout:
    token t is bit t % 32 of word t // 32) set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    keep = ((allowed.unsqueeze(-1) >> shifts) & 1).view(x.shape[0], -1)[:, : x.shape[1]]
    return x.masked_fill(keep == 0, float("-inf"))


def allowed_tokens(n: int, at: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """int32 [n, W]: the constrained rows `at` hold their `mask` rows, the others every token (-1)."""
    allowed = torch.full((n, mask.shape[1]), -1, dtype=torch.int32, device=mask.device)
    return allowed.index_copy_(0, at, mask)


class StepSampler:
    def __init__(self, flat_pool: torch.Tensor, state: ProcessorState, kernels: Kernels = Kernels()) -> None:
        self.flat_pool, self.state, self.kernels = flat_pool, state, kernels

    def __call__(
        self, logits: torch.Tensor, a: SampleArgs, *, procs: bool, filtered: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int32 [B] sampled tokens (written into `out` when given). `procs`: apply the processors (and
        grammar masks) of `a` that are given; `filtered`: top-k and top-p; min-p when `a.min_p` is given."""
        x = logits
        if procs:
            if a.state_row is not None:
                x = self.state.apply(x, a.state_row, a.presence, a.frequency, a.repetition, a.ban_stop, a.proposed)
            if a.allowed is not None:
                x = apply_bitmask(x, a.allowed)
        if a.temperature is None:
            tokens = x.argmax(dim=-1).to(torch.int32)
            # the next step reads its input here, on the device: the host never has to know it first
            self.flat_pool.index_copy_(0, a.token_write, tokens)
            if out is not None:
                tokens = out.copy_(tokens)
        else:
            if a.min_p is not None:
                x = apply_min_p(x, a.temperature, a.min_p)
            if filtered:
                x = filter_logits(x, a.temperature, a.top_p, a.top_k)
            tokens = self._draw(x, a, out)
        if procs and a.state_row is not None:
            self.state.update(a.state_row, tokens, kept_samples(tokens, *a.verify) if a.verify is not None else None)
        return tokens

    def _draw(self, x: torch.Tensor, a: SampleArgs, out: torch.Tensor | None) -> torch.Tensor:
        if triton_ops.kernels_available(self.kernels, x):
            return triton_ops.sample_rows(
                x,
                a.temperature,
                a.seeds,
                a.positions,
                out=out,
                token_pool=self.flat_pool,
                token_write=a.token_write,
                pdl=triton_ops.pdl_applies(self.kernels, x.device),
            )
        tokens = sample_unfiltered(x, a.temperature, a.seeds, a.positions).to(torch.int32)
        self.flat_pool.index_copy_(0, a.token_write, tokens)
        if out is not None:
            return out.copy_(tokens)
        return tokens
