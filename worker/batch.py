"""What one step computes: the serializable description rank 0 broadcasts, and its device-side form."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class BatchDesc:
    """A step, described on rank 0 and applied identically by every rank. Arrays are per request
    ([B]) except `input_ids` and `out_loc`, which hold every new token of the step ([T])."""

    is_prefill: bool
    table_idx: np.ndarray      # int32 [B]: each request's slot (its token-pool and page-table row)
    seq_lens: np.ndarray       # int32 [B]: tokens with KV once this step is done
    extend_lens: np.ndarray    # int32 [B]: tokens computed this step (1 in decode)
    out_loc: np.ndarray        # int32 [T]: the KV-cache location each new token writes
    input_ids: np.ndarray | None  # int32 [T]: prompt tokens (prefill); decode reads its input from the token pool
    temperature: np.ndarray    # float32 [B]; 0 is greedy
    top_p: np.ndarray          # float32 [B]
    top_k: np.ndarray          # int32 [B]; <= 0 is off
    seeds: np.ndarray          # int64 [B]
    # page-table rows of prefix-cache hits: (slot, KV locations of positions 0..len-1)
    prefix_rows: list[tuple[int, np.ndarray]] = field(default_factory=list)
    top_logprobs: int = -1     # -1: no logprobs; k >= 0: the sampled token's logprob and the k most likely

    @property
    def batch_size(self) -> int:
        return len(self.table_idx)

    @property
    def num_tokens(self) -> int:
        return len(self.out_loc)


@dataclass
class ForwardBatch:
    """A BatchDesc moved to the device, with what attention and sampling derive from it."""

    desc: BatchDesc
    input_ids: torch.Tensor    # [T]
    positions: torch.Tensor    # int64 [T]
    out_loc: torch.Tensor      # int64 [T]
    table_idx: torch.Tensor    # int64 [B]
    seq_lens: torch.Tensor     # int32 [B]
    last_idx: torch.Tensor     # int64 [B]: where each request's last new token sits in [T]


@dataclass
class StepOutput:
    """The sampled tokens of a step, copied to host memory asynchronously; `done` marks the copy."""

    next_tokens: torch.Tensor  # int32 [B] on the host
    done: object               # an event with synchronize()
    logprobs: torch.Tensor | None = None       # float32 [B] on the host
    top_ids: torch.Tensor | None = None        # int32 [B, k]
    top_logprobs: torch.Tensor | None = None   # float32 [B, k]
