"""The step broadcast (worker/comm.py): a batch description packed into a byte tensor on rank 0 is
unpacked into the identical description on a follower, over a 2-process gloo group, with the
keepalive and stop messages between steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from worker.batch import BatchDesc, desc_layout, pack_desc, packed_nbytes, unpack_desc
from worker.comm import DescChannel, Keepalive, destroy_tensor_parallel, free_address, init_tensor_parallel


def random_desc(
    rng: np.random.Generator,
    is_prefill: bool,
    batch: int,
    tokens_each: int = 1,
    prefix_slots: int = 0,
    top_logprobs: int = -1,
) -> BatchDesc:
    extend = rng.integers(1, 2 * tokens_each + 1, batch).astype(np.int32) if is_prefill else np.ones(batch, np.int32)
    tokens = int(extend.sum())
    rows = [
        (int(rng.integers(0, 4096)), rng.integers(0, 1 << 30, int(rng.integers(0, 300))).astype(np.int32))
        for _ in range(prefix_slots)
    ]
    return BatchDesc(
        is_prefill=is_prefill,
        slots=rng.permutation(4096)[:batch].astype(np.int32),
        seq_lens=(extend + rng.integers(0, 30000, batch)).astype(np.int32),
        extend_lens=extend,
        out_loc=rng.integers(0, 1 << 30, tokens).astype(np.int32),
        input_ids=rng.integers(0, 152000, tokens).astype(np.int32) if is_prefill else None,
        temperature=rng.choice([0.0, 0.6, 1.3], batch).astype(np.float32),
        top_p=rng.uniform(0.1, 1.0, batch).astype(np.float32),
        top_k=rng.integers(-1, 100, batch).astype(np.int32),
        seeds=rng.integers(-(1 << 63), (1 << 63) - 1, batch, dtype=np.int64),
        prefix_slots=rows,
        top_logprobs=top_logprobs,
    )


def messages() -> list[BatchDesc | Keepalive | None]:
    """What rank 0 sends, rebuilt alike on every rank: small and large steps in turn (the large ones
    overflow the fixed message), so a step that reuses a buffer a larger one filled is checked too."""
    rng = np.random.default_rng(7)
    out: list[BatchDesc | Keepalive | None] = []
    for _ in range(3):
        out += [
            random_desc(rng, False, 1),
            random_desc(rng, False, 64, top_logprobs=0),
            random_desc(rng, True, 4, tokens_each=2048, prefix_slots=3, top_logprobs=5),
            Keepalive(),
            random_desc(rng, False, 256, prefix_slots=2),
            random_desc(rng, True, 1, tokens_each=3),
            random_desc(rng, False, 2000),
            random_desc(rng, True, 3, tokens_each=40, prefix_slots=1),
        ]
    return out + [None]


def assert_same(got: BatchDesc | Keepalive | None, want: BatchDesc | Keepalive | None) -> None:
    if not isinstance(want, BatchDesc):
        assert got == want
        return
    assert isinstance(got, BatchDesc)
    for name in ("slots", "seq_lens", "extend_lens", "out_loc", "input_ids", "temperature", "top_p", "top_k", "seeds"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (got.is_prefill, got.top_logprobs) == (want.is_prefill, want.top_logprobs)
    assert [s for s, _ in got.prefix_slots] == [s for s, _ in want.prefix_slots]
    assert all(type(s) is int for s, _ in got.prefix_slots)
    for (_, a), (_, b) in zip(got.prefix_slots, want.prefix_slots):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _rank(rank: int, address: str, report: str) -> None:
    tp = init_tensor_parallel(rank, 2, address, torch.device("cpu"), 30)
    try:
        checked = 0
        for want in messages():
            got = tp.comm.broadcast_desc(want if rank == 0 else None)
            assert_same(got, want)
            checked += 1
        Path(f"{report}.{rank}").write_text(str(checked))  # a rank that failed writes nothing
    finally:
        destroy_tensor_parallel()


def test_every_rank_gets_the_identical_description_keepalive_and_stop(tmp_path):
    report = str(tmp_path / "checked")
    mp.spawn(_rank, args=(free_address("127.0.0.1"), report), nprocs=2, join=True)
    assert [int(Path(f"{report}.{rank}").read_text()) for rank in (0, 1)] == [len(messages())] * 2


@pytest.mark.parametrize(
    "is_prefill,batch,rows,top_logprobs", [(False, 1, 0, -1), (False, 256, 0, 3), (True, 8, 0, -1), (True, 5, 4, 0)]
)
def test_a_packed_description_unpacks_into_views_of_its_buffer(is_prefill, batch, rows, top_logprobs):
    desc = random_desc(
        np.random.default_rng(batch), is_prefill, batch, tokens_each=16, prefix_slots=rows, top_logprobs=top_logprobs
    )
    layout = desc_layout(desc)
    buf = np.zeros(packed_nbytes(layout), np.uint8)
    pack_desc(desc, layout, buf)
    got = unpack_desc(layout, buf)
    assert_same(got, desc)
    assert np.shares_memory(got.seeds, buf) and np.shares_memory(got.out_loc, buf)


def test_a_decode_step_of_256_requests_fits_one_broadcast():
    desc = random_desc(np.random.default_rng(0), False, 256)
    assert packed_nbytes(desc_layout(desc)) <= DescChannel.INLINE_BYTES
