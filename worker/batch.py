"""What one step computes: the description rank 0 broadcasts (and its packed wire form), and its
device-side form."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker.sampling.columns import COLUMNS, GROUPS, MIN_P, PROCS, columns_of
from worker.sampling.processors import ProcessorInit, ProcessorRows


@dataclass
class BatchDesc:
    """A step, described on rank 0 and applied identically by every rank. Arrays are per request
    ([B]) except `input_ids` and `out_loc`, which hold every new token of the step ([T]). The sampling
    columns (temperature .. min_p, and `procs`' fields) are those of worker/sampling/columns.py."""

    is_prefill: bool
    slots: np.ndarray  # int32 [B]: each request's slot (its token-pool and page-table row)
    seq_lens: np.ndarray  # int32 [B]: tokens with KV once this step is done
    extend_lens: np.ndarray  # int32 [B]: tokens computed this step (1 in decode)
    out_loc: np.ndarray  # int32 [T]: the KV-cache location each new token writes
    input_ids: np.ndarray | None  # int32 [T]: prompt tokens (prefill); decode reads its input from the token pool
    temperature: np.ndarray  # float32 [B]; 0 is greedy
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B]; <= 0 is off
    seeds: np.ndarray  # int64 [B]
    # page-table rows of prefix-cache hits: (slot, KV locations of positions 0..len-1)
    prefix_slots: list[tuple[int, np.ndarray]] = field(default_factory=list)
    top_logprobs: int = -1  # -1: no logprobs; k >= 0: the sampled token's logprob and the k most likely
    min_p: np.ndarray | None = None  # float32 [B]; None: 0 for every row
    procs: ProcessorRows | None = None  # when some row uses penalties, biases or min_tokens
    proc_init: list[ProcessorInit] = field(default_factory=list)  # slots whose processor state starts afresh
    # prompt logprobs (prefill): the step's tokens whose next prompt token is scored, and that token
    prompt_logprobs: int = -1  # -1: none; k >= 0: with the k most likely
    plp_idx: np.ndarray | None = None  # int32 [P]: indices into the step's T tokens
    plp_target: np.ndarray | None = None  # int32 [P]
    # constrained samples (grammars): which of the step's samples (a row's, or in a verify step each of a
    # row's spec_len + 1), and their allowed tokens (one bit a token)
    grammar_rows: np.ndarray | None = None  # int32 [G]
    grammar_mask: np.ndarray | None = None  # int32 [G, W]
    # speculative decoding (an extend step): tokens proposed per row, which follow the row's input at
    # the end of its extend; a row with s of them samples at its last s + 1 positions, and keeps the
    # samples up to the first that differs from its proposal. None: every row samples once.
    spec_lens: np.ndarray | None = None  # int32 [B]
    # an EAGLE-3 draft head's steps (rank 0's draft engine alone; never broadcast): where each token's
    # hidden state from the model sits in the model's auxiliary-hidden cache (None: each row goes on
    # from its own last hidden state), and how far past its seq_len a row's sample lands (the head runs
    # a position behind the tokens it takes, so its noise is the model's one position on)
    hidden_loc: np.ndarray | None = None  # int32 [T]
    sample_shift: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return len(self.out_loc)


# Where a description holds each group's sampling columns: its own fields, or the processors' record;
# an optional group is None when no row of the step uses it.
_OPTIONAL_GROUPS = (MIN_P, PROCS)


def _holder(desc: BatchDesc, group: str) -> object | None:
    if group == PROCS:
        return desc.procs
    if group == MIN_P and desc.min_p is None:
        return None
    return desc


def desc_columns(desc: BatchDesc) -> dict[str, np.ndarray]:
    """The sampling columns (worker/sampling/columns.py) that `desc` holds, by name."""
    holders = {g: _holder(desc, g) for g in GROUPS}
    return {c.name: getattr(holders[c.group], c.name) for c in COLUMNS if holders[c.group] is not None}


# The packed form of a BatchDesc (worker/comm.py broadcasts it): a few integers that fix its layout,
# then every array back to back in one byte payload, the widest first, so that each lies aligned.
# Unpacking makes numpy views of the payload: no copy, no unpickling.
_LAYOUT = (
    "is_prefill",
    "B",
    "T",
    "has_ids",
    "prefix_slots",
    "prefix_locs",
    "top_logprobs",
    *(f"has_{g}" for g in _OPTIONAL_GROUPS),
    "inits",
    "init_prompt",
    "init_output",
    "init_sparse",
    "plp",
    "prompt_logprobs",
    "grammar_rows",
    "grammar_words",
    "has_spec",
)
LAYOUT_LEN = len(_LAYOUT)

_I32, _F32, _U8 = np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint8)

# (name, dtype, what sizes it: a count of _counts); the sampling columns' sections follow their declaration
_SECTIONS = tuple(
    sorted(
        (
            ("slots", _I32, "B"),
            ("seq_lens", _I32, "B"),
            ("extend_lens", _I32, "B"),
            ("out_loc", _I32, "T"),
            ("input_ids", _I32, "T_ids"),
            ("prefix_slots", _I32, "prefix_slots"),
            ("prefix_lens", _I32, "prefix_slots"),
            ("prefix_locs", _I32, "prefix_locs"),
            ("init_slots", _I32, "inits"),
            ("init_prompt_lens", _I32, "inits"),
            ("init_output_lens", _I32, "inits"),
            ("init_sparse_lens", _I32, "inits"),
            ("init_prompt", _I32, "init_prompt"),
            ("init_output", _I32, "init_output"),
            ("init_sparse_ids", _I32, "init_sparse"),
            ("init_sparse_bias", _F32, "init_sparse"),
            ("plp_idx", _I32, "plp"),
            ("plp_target", _I32, "plp"),
            ("grammar_rows", _I32, "grammar_rows"),
            ("grammar_mask", _I32, "grammar_mask"),
            ("spec_lens", _I32, "B_spec"),
            ("init_sparse_ban", _U8, "init_sparse"),
            *((c.name, c.dtype, f"B_{c.group}" if c.group in _OPTIONAL_GROUPS else "B") for c in COLUMNS),
        ),
        key=lambda section: -section[1].itemsize,
    )
)


def desc_layout(desc: BatchDesc) -> tuple[int, ...]:
    """The integers that, with the payload, give back `desc` (LAYOUT_LEN of them)."""
    inits = desc.proc_init
    return (
        int(desc.is_prefill),
        desc.batch_size,
        desc.num_tokens,
        int(desc.input_ids is not None),
        len(desc.prefix_slots),
        sum(len(locs) for _, locs in desc.prefix_slots),
        desc.top_logprobs,
        *(int(_holder(desc, g) is not None) for g in _OPTIONAL_GROUPS),
        len(inits),
        sum(len(x.prompt_ids) for x in inits),
        sum(len(x.output_ids) for x in inits),
        sum(len(x.sparse_ids) for x in inits),
        0 if desc.plp_idx is None else len(desc.plp_idx),
        desc.prompt_logprobs,
        0 if desc.grammar_rows is None else len(desc.grammar_rows),
        0 if desc.grammar_mask is None else desc.grammar_mask.shape[1],
        int(desc.spec_lens is not None),
    )


def _counts(layout: tuple[int, ...]) -> dict[str, int]:
    v = dict(zip(_LAYOUT, layout))
    return {
        **v,
        **{f"B_{g}": v["B"] * v[f"has_{g}"] for g in _OPTIONAL_GROUPS},
        "T_ids": v["T"] * v["has_ids"],
        "grammar_mask": v["grammar_rows"] * v["grammar_words"],
        "B_spec": v["B"] * v["has_spec"],
    }


def packed_nbytes(layout: tuple[int, ...]) -> int:
    counts = _counts(layout)
    return sum(dtype.itemsize * counts[which] for _, dtype, which in _SECTIONS)


def _flat(desc: BatchDesc) -> dict[str, object]:
    """Every section's values, by name."""
    rows, inits = desc.prefix_slots, desc.proc_init
    cat = np.concatenate
    out: dict[str, object] = {
        "prefix_slots": [slot for slot, _ in rows],
        "prefix_lens": [len(locs) for _, locs in rows],
        "prefix_locs": cat([locs for _, locs in rows]) if rows else (),
        "init_slots": [x.slot for x in inits],
        "init_prompt_lens": [len(x.prompt_ids) for x in inits],
        "init_output_lens": [len(x.output_ids) for x in inits],
        "init_sparse_lens": [len(x.sparse_ids) for x in inits],
        **desc_columns(desc),
    }
    for key, name in (
        ("init_prompt", "prompt_ids"),
        ("init_output", "output_ids"),
        ("init_sparse_ids", "sparse_ids"),
        ("init_sparse_bias", "sparse_bias"),
        ("init_sparse_ban", "sparse_ban"),
    ):
        out[key] = cat([getattr(x, name) for x in inits]) if inits else ()
    if desc.grammar_mask is not None:
        out["grammar_mask"] = desc.grammar_mask.reshape(-1)
    return out


def pack_desc(desc: BatchDesc, layout: tuple[int, ...], out: np.ndarray) -> None:
    """Writes `desc`'s arrays into the uint8 buffer `out` (at least packed_nbytes(layout) long), each
    cast to its field's dtype."""
    flat, counts, offset = _flat(desc), _counts(layout), 0
    for name, dtype, which in _SECTIONS:
        if n := counts[which]:
            np.frombuffer(out, dtype, n, offset)[:] = flat[name] if name in flat else getattr(desc, name)
            offset += dtype.itemsize * n


def _split(values: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    return np.split(values, np.cumsum(lens[:-1])) if len(lens) else []


def unpack_desc(layout: tuple[int, ...], payload: np.ndarray) -> BatchDesc:
    """The BatchDesc that pack_desc wrote into `payload`; its arrays are views of it, valid until it is
    written again."""
    a, counts, offset = {}, _counts(layout), 0
    for name, dtype, which in _SECTIONS:
        n = counts[which]
        a[name] = np.frombuffer(payload, dtype, n, offset)
        offset += dtype.itemsize * n
    v = dict(zip(_LAYOUT, layout))
    prefix_slots = list(zip(a["prefix_slots"].tolist(), _split(a["prefix_locs"], a["prefix_lens"])))
    inits = [
        ProcessorInit(slot, prompt, output, ids, bias, ban)
        for slot, prompt, output, ids, bias, ban in zip(
            a["init_slots"].tolist(),
            _split(a["init_prompt"], a["init_prompt_lens"]),
            _split(a["init_output"], a["init_output_lens"]),
            _split(a["init_sparse_ids"], a["init_sparse_lens"]),
            _split(a["init_sparse_bias"], a["init_sparse_lens"]),
            _split(a["init_sparse_ban"], a["init_sparse_lens"]),
        )
    ]
    columns = {c.name: a[c.name] if v.get(f"has_{c.group}", 1) else None for c in COLUMNS}
    procs_columns = {c.name: columns.pop(c.name) for c in columns_of(PROCS)}
    procs = ProcessorRows(**procs_columns) if v[f"has_{PROCS}"] else None
    return BatchDesc(
        is_prefill=bool(v["is_prefill"]),
        slots=a["slots"],
        seq_lens=a["seq_lens"],
        extend_lens=a["extend_lens"],
        out_loc=a["out_loc"],
        input_ids=a["input_ids"] if v["has_ids"] else None,
        **columns,
        prefix_slots=prefix_slots,
        top_logprobs=int(v["top_logprobs"]),
        procs=procs,
        proc_init=inits,
        prompt_logprobs=int(v["prompt_logprobs"]),
        plp_idx=a["plp_idx"] if v["plp"] else None,
        plp_target=a["plp_target"] if v["plp"] else None,
        grammar_rows=a["grammar_rows"] if v["grammar_rows"] else None,
        grammar_mask=a["grammar_mask"].reshape(v["grammar_rows"], v["grammar_words"]) if v["grammar_rows"] else None,
        spec_lens=a["spec_lens"] if v["has_spec"] else None,
    )


@dataclass
class ForwardBatch:
    """A BatchDesc moved to the device, with what attention and sampling derive from it."""

    desc: BatchDesc
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # int64 [T]
    out_loc: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int32 [B]
    last_idx: torch.Tensor  # int64 [B]: where each request's last new token sits in [T]


@dataclass
class StepOutput:
    """The sampled tokens of a step, copied to host memory asynchronously; `done` marks the copy. With
    speculative decoding (desc.spec_lens) a row has spec_len + 1 samples, back to back, and keeps those
    up to its first that differs from the proposal after it (sampling.verify.kept_counts); the logprobs
    are of every sample."""

    next_tokens: torch.Tensor  # int32 [B] (with spec_lens: [sum(spec_lens + 1)]) on the host
    done: object  # an event with synchronize()
    logprobs: torch.Tensor | None = None  # float32 [B] on the host
    top_ids: torch.Tensor | None = None  # int32 [B, k]
    top_logprobs: torch.Tensor | None = None  # float32 [B, k]
    # prompt logprobs of the step's scored tokens (desc.plp_idx): the target's, and the k most likely
    prompt_logprobs: torch.Tensor | None = None  # float32 [P]
    prompt_top_ids: torch.Tensor | None = None  # int32 [P, k]
    prompt_top_logprobs: torch.Tensor | None = None  # float32 [P, k]
