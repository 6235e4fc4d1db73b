"""What one step computes: the description rank 0 broadcasts (and its packed wire form), and its
device-side form."""

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


# The packed form of a BatchDesc (worker/comm.py broadcasts it): a few integers that fix its layout,
# then every array back to back in one byte payload, the int64 one first so that each lies aligned.
# Unpacking makes numpy views of the payload: no copy, no unpickling.
LAYOUT_LEN = 7  # is_prefill, batch size, tokens, has input_ids, prefix rows, prefix locations, top_logprobs


def desc_layout(desc: BatchDesc) -> tuple[int, ...]:
    """The integers that, with the payload, give back `desc` (LAYOUT_LEN of them)."""
    return (int(desc.is_prefill), desc.batch_size, desc.num_tokens, int(desc.input_ids is not None),
            len(desc.prefix_rows), sum(len(locs) for _, locs in desc.prefix_rows), desc.top_logprobs)


# (field, dtype, which count of the layout sizes it: 1 requests, 2 tokens, 3 tokens if input_ids,
# 4 prefix rows, 5 prefix locations)
_SECTIONS = (("seeds", np.dtype(np.int64), 1), ("table_idx", np.dtype(np.int32), 1),
             ("seq_lens", np.dtype(np.int32), 1), ("extend_lens", np.dtype(np.int32), 1),
             ("top_k", np.dtype(np.int32), 1), ("temperature", np.dtype(np.float32), 1),
             ("top_p", np.dtype(np.float32), 1), ("out_loc", np.dtype(np.int32), 2),
             ("input_ids", np.dtype(np.int32), 3), ("prefix_slots", np.dtype(np.int32), 4),
             ("prefix_lens", np.dtype(np.int32), 4), ("prefix_locs", np.dtype(np.int32), 5))


def _counts(layout: tuple[int, ...]) -> tuple[int, ...]:
    _, b, t, has_ids, rows, locs, _ = layout
    return (0, b, t, t * has_ids, rows, locs)


def packed_nbytes(layout: tuple[int, ...]) -> int:
    counts = _counts(layout)
    return sum(dtype.itemsize * counts[which] for _, dtype, which in _SECTIONS)


def pack_desc(desc: BatchDesc, layout: tuple[int, ...], out: np.ndarray) -> None:
    """Writes `desc`'s arrays into the uint8 buffer `out` (at least packed_nbytes(layout) long), each
    cast to its field's dtype."""
    rows = desc.prefix_rows
    prefix = {"prefix_slots": [slot for slot, _ in rows], "prefix_lens": [len(locs) for _, locs in rows],
              "prefix_locs": np.concatenate([locs for _, locs in rows]) if rows else ()}
    counts, offset = _counts(layout), 0
    for name, dtype, which in _SECTIONS:
        if n := counts[which]:
            np.frombuffer(out, dtype, n, offset)[:] = prefix[name] if name in prefix else getattr(desc, name)
            offset += dtype.itemsize * n


def unpack_desc(layout: tuple[int, ...], payload: np.ndarray) -> BatchDesc:
    """The BatchDesc that pack_desc wrote into `payload`; its arrays are views of it, valid until it is
    written again."""
    arrays, counts, offset = {}, _counts(layout), 0
    for name, dtype, which in _SECTIONS:
        n = counts[which]
        arrays[name] = np.frombuffer(payload, dtype, n, offset)
        offset += dtype.itemsize * n
    is_prefill, _, _, has_ids, rows, _, top_logprobs = layout
    prefix_rows = []
    if rows:
        locs = np.split(arrays["prefix_locs"], np.cumsum(arrays["prefix_lens"][:-1]))
        prefix_rows = list(zip(arrays["prefix_slots"].tolist(), locs))
    return BatchDesc(
        is_prefill=bool(is_prefill), table_idx=arrays["table_idx"], seq_lens=arrays["seq_lens"],
        extend_lens=arrays["extend_lens"], out_loc=arrays["out_loc"],
        input_ids=arrays["input_ids"] if has_ids else None, temperature=arrays["temperature"],
        top_p=arrays["top_p"], top_k=arrays["top_k"], seeds=arrays["seeds"], prefix_rows=prefix_rows,
        top_logprobs=int(top_logprobs))


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
