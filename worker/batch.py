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


def _sections(layout: tuple[int, ...]) -> list[tuple[str, type, int]]:
    _, b, t, has_ids, rows, locs, _ = layout
    return [("seeds", np.int64, b), ("table_idx", np.int32, b), ("seq_lens", np.int32, b),
            ("extend_lens", np.int32, b), ("top_k", np.int32, b), ("temperature", np.float32, b),
            ("top_p", np.float32, b), ("out_loc", np.int32, t), ("input_ids", np.int32, t * has_ids),
            ("prefix_slots", np.int32, rows), ("prefix_lens", np.int32, rows), ("prefix_locs", np.int32, locs)]


def packed_nbytes(layout: tuple[int, ...]) -> int:
    return sum(np.dtype(dtype).itemsize * n for _, dtype, n in _sections(layout))


def pack_desc(desc: BatchDesc, layout: tuple[int, ...], out: np.ndarray) -> None:
    """Writes `desc`'s arrays into the uint8 buffer `out` (at least packed_nbytes(layout) long), each
    cast to its field's dtype."""
    rows = desc.prefix_rows
    arrays = {"prefix_slots": [slot for slot, _ in rows], "prefix_lens": [len(locs) for _, locs in rows],
              "prefix_locs": np.concatenate([locs for _, locs in rows]) if rows else ()}
    offset = 0
    for name, dtype, n in _sections(layout):
        size = np.dtype(dtype).itemsize * n
        if n:
            out[offset:offset + size].view(dtype)[:] = arrays[name] if name in arrays else getattr(desc, name)
        offset += size


def unpack_desc(layout: tuple[int, ...], payload: np.ndarray) -> BatchDesc:
    """The BatchDesc that pack_desc wrote into `payload`; its arrays are views of it, valid until it is
    written again."""
    arrays, offset = {}, 0
    for name, dtype, n in _sections(layout):
        size = np.dtype(dtype).itemsize * n
        arrays[name] = payload[offset:offset + size].view(dtype)
        offset += size
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
