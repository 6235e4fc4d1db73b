"""Pinned staging: a step's arrays come back as they were packed, whether their layout is new, seen
before (its views are reused), or too large for the slot (it grows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.staging import PinnedStaging


def _arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "idx": rng.integers(0, 1 << 40, n),
        "val": rng.integers(-5, 5, n).astype(np.int32),
        "temp": rng.random(n).astype(np.float32),
        "flag": rng.random(n) < 0.5,
    }


@pytest.mark.parametrize("sizes", [[3, 3, 3, 3], [3, 7, 3, 1, 7], [4, 5000, 4]], ids=["same", "mixed", "grows"])
def test_uploads_read_back_as_packed(sizes):
    staging = PinnedStaging(torch.device("cpu"), depth=2, capacity=256)
    rng = np.random.default_rng(0)
    for n in sizes:
        arrays = _arrays(rng, n)
        staged = staging.upload(arrays)
        for name, a in arrays.items():
            for got in (staged.host[name], staged.device[name]):
                assert got.dtype == torch.from_numpy(a).dtype and got.tolist() == a.tolist()
        staged.release()


def test_a_slot_in_use_is_not_reused():
    staging = PinnedStaging(torch.device("cpu"), depth=1, capacity=256)
    staging.upload({"x": np.arange(3)})
    with pytest.raises(RuntimeError, match="reused"):
        staging.upload({"x": np.arange(3)})
