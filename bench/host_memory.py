"""The peak of this process's anonymous resident memory while a block runs (Linux), sampled every millisecond: the
arrays and tensors the block makes, not the files it maps (a checkpoint's pages)."""

from __future__ import annotations

import threading
import time
from pathlib import Path


def anon_mb() -> float:
    """This process's resident anonymous memory now, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakAnonMemory:
    """`with PeakAnonMemory() as memory: ...`, then `memory.peak_mb`: the peak above the memory before the block."""

    def __enter__(self) -> PeakAnonMemory:
        self.before = self.peak = anon_mb()
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, anon_mb())
            time.sleep(0.001)

    def __exit__(self, *_) -> None:
        self._done.set()
        self._sampler.join()
        self.peak = max(self.peak, anon_mb())

    @property
    def peak_mb(self) -> float:
        return self.peak - self.before
