"""bench/peer_prefill_heavy.py gives mini-sglang the prefill-heavy workload's own token lists: the prompts and
output lengths bench/offline_throughput.py draws for the project, so the two engines' figures compare."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])  # offline_throughput imports bench/common.py


def test_the_peers_prefill_heavy_draw_is_the_projects(bench_path):
    offline = _module("offline_throughput")
    peer = _module("peer_prefill_heavy")
    n, (p_lo, p_hi), (o_lo, o_hi) = offline.WORKLOADS["prefill_heavy"]
    assert (peer.REQUESTS, peer.PROMPT_LENS, peer.OUTPUT_LENS) == (n, (p_lo, p_hi), (o_lo, o_hi))
    prompts, params = offline.workload(n, 0, peer.VOCAB, "prefill_heavy")
    peer_prompts, max_tokens = peer.prefill_heavy()
    assert peer_prompts == prompts
    assert max_tokens == [p.max_tokens for p in params]
    assert max(map(len, prompts)) + max(max_tokens) <= peer.MAX_SEQ_LEN
