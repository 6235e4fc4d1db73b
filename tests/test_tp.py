"""Tensor parallelism on the CPU (gloo, tp=2, Ray actors): rank 0 schedules and broadcasts, the
follower applies; outputs equal tp=1 and Hugging Face; failures end requests instead of hanging, and
the step-time benchmark says where its ranks are instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import live_ray_objects
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy

from cluster import LLM, GrammarSpec, SamplingParams
from cluster.config import ReplicaConfig, SchedulerConfig
from cluster.errors import GenerationError
from cluster.messages import AddRequest, TokenDelta
from cluster.replica.actor import SchedulerActor
from cluster.scheduler.executor import ReplicaBrokenError
from worker.config import EngineConfig


@pytest.mark.parametrize(
    "family,overlap,cache_type,preempting",
    # the normal loop at tp=2: the penalties test below
    [("qwen3", True, "radix", False), ("llama", True, "naive", True)],
)
def test_tp2_greedy_equals_tp1_and_hf(ray_cluster, model_paths, family, overlap, cache_type, preempting):
    path = model_paths[family]
    # preempting: too few pages for every request's growth, so rank 0 preempts and recomputes some
    kw = dict(
        overlap=overlap,
        cache_type=cache_type,
        page_size=4,
        **(dict(num_pages=80, decode_reserve_tokens=1) if preempting else {}),
    )
    with checked_llm(path, tp_size=2, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        tp2 = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        assert [o.token_ids for o in llm.generate(prompts, greedy(10))] == tp2  # warm prefix cache
        assert (llm.stats().preempted > 0) == preempting
    with checked_llm(path, **kw) as llm:
        tp1 = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    assert tp2 == tp1 == hf_greedy(path, prompts, 10)


def test_tp2_with_a_single_kv_head_replicates_it(ray_cluster, qwen3_one_kv_head_path):
    with checked_llm(qwen3_one_kv_head_path, tp_size=2) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        outs = llm.generate(prompts, greedy(10))
    assert [o.token_ids for o in outs] == hf_greedy(qwen3_one_kv_head_path, prompts, 10)


def test_tp2_seeded_sampling_equals_tp1_and_aborts_keep_every_rank_whole(ray_cluster, qwen3_path):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=12, seed=s, ignore_eos=True) for s in range(6)
    ]
    with checked_llm(qwen3_path) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        tp1 = [o.token_ids for o in llm.generate(prompts, params)]
    with checked_llm(qwen3_path, tp_size=2) as llm:
        tp2 = [o.token_ids for o in llm.generate(prompts, params)]
        # abort half of a running batch part-way through, then check the pages and that both ranks
        # still agree (a rank out of step would change the outputs that follow)
        actor = llm.replica.actor
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        actor.submit.remote([AddRequest(1000 + i, p, long) for i, p in enumerate(prompts)])
        got = []
        while not got:
            got = ray_cluster.get(actor.poll.remote(1.0))
        ray_cluster.get(actor.abort.remote([1000, 1002, 1004]))
        finished = {d.uid for d in got if d.finished}
        while len(finished) < 3:
            deltas = ray_cluster.get(actor.poll.remote(1.0))
            finished |= {d.uid for d in deltas if d.finished}
        assert finished == {1001, 1003, 1005}
        after = [o.token_ids for o in llm.generate(prompts, greedy(8))]
    assert tp2 == tp1
    assert after == hf_greedy(qwen3_path, prompts, 8)


@pytest.mark.parametrize("family,overlap", [("qwen3", True), ("llama", False)])
def test_tp2_penalties_biases_min_tokens_choices_and_prompt_logprobs_equal_tp1(
    ray_cluster, model_paths, family, overlap
):
    """Every rank applies the same processors (and grammar masks) to the same gathered logits and counts
    the same tokens:
    tp=2 equals tp=1 (which tests/test_sampling.py referees against Hugging Face for every family, both
    loops); here for two families and both loops (in the overlap loop step N+1's penalties need step N's
    token on the device)."""
    path = model_paths[family]
    params = [
        greedy(16, ignore_eos=True, repetition_penalty=1.6),
        greedy(16, ignore_eos=True, logit_bias={5: 3.0}),
        greedy(16, stop_token_ids=[7], min_tokens=6),
        greedy(16, presence_penalty=0.8, frequency_penalty=0.9),
        SamplingParams(temperature=0.9, min_p=0.05, max_tokens=10, n=3, seed=77),
        SamplingParams(temperature=0.9, max_tokens=40, seed=3, grammar=GrammarSpec("regex", "[a-z]{3,9} ok")),
        greedy(4, prompt_logprobs=2),
    ]

    def run(llm):
        outs = llm.generate(encode_all(llm, PROMPT_TEXTS[: len(params)]), params)
        return [[o.token_ids for o in out.outputs] for out in outs], outs[-1].prompt_logprobs

    with checked_llm(path, tp_size=2, overlap=overlap, page_size=4) as llm:
        tp2, tp2_scores = run(llm)
    with checked_llm(path, overlap=overlap, page_size=4) as llm:
        tp1, tp1_scores = run(llm)
    assert tp2 == tp1
    assert [top for _, top in tp2_scores] == [top for _, top in tp1_scores] or [
        [i for i, _ in top] for _, top in tp2_scores
    ] == [[i for i, _ in top] for _, top in tp1_scores]
    assert [lp for lp, _ in tp2_scores] == pytest.approx([lp for lp, _ in tp1_scores], abs=1e-4)


def test_killed_follower_fails_requests_with_an_error_not_a_hang(ray_cluster, qwen3_path):
    llm = LLM(str(qwen3_path), tp_size=2, collective_timeout_s=10)
    try:
        ray_cluster.kill(llm.replica.followers[0])
        start = time.monotonic()
        with pytest.raises(GenerationError, match="tensor-parallel group failed"):
            llm.generate(PROMPT_TEXTS[:3], greedy(8))
        assert time.monotonic() - start < 15
    finally:
        llm.shutdown()


def test_every_rank_is_named_for_the_dashboard_and_shutdown_leaves_no_actor_or_placement_group(ray_cluster, qwen3_path):
    import ray._private.state as state

    with checked_llm(qwen3_path, tp_size=2) as llm:
        suffix = llm.replica.suffix
        names = {v["Name"] for v in state.actors().values() if v["State"] == "ALIVE"}
        assert {f"raylm-replica-0-rank-0-{suffix}", f"raylm-replica-0-rank-1-{suffix}"} <= names
        assert llm.generate(PROMPT_TEXTS[:1], greedy(2, ignore_eos=True))[0].token_ids
    deadline = time.monotonic() + 30
    while live_ray_objects() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_ray_objects() == ([], [])


def test_stalled_follower_times_out_instead_of_hanging(ray_cluster, qwen3_path):
    import os
    import signal

    llm = LLM(str(qwen3_path), tp_size=2, collective_timeout_s=4)
    _, pid = ray_cluster.get(llm.replica.followers[0].node_and_pid.remote())
    try:
        os.kill(pid, signal.SIGSTOP)  # alive but answering nothing: a hung rank
        start = time.monotonic()
        with pytest.raises(GenerationError, match="tensor-parallel group failed"):
            llm.generate(PROMPT_TEXTS[:2], greedy(8))
        assert time.monotonic() - start < 20
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.shutdown()


class _HangingExecutor:
    """Wraps a replica's executor. Once `hang` is set, a launch blocks on the host, as a GPU rank's
    host does when a peer of its collective is gone (the kernel spins; it never returns an error)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.hang, self.release = threading.Event(), threading.Event()
        self._since: float | None = None

    def launch(self, desc):
        if self.hang.is_set():
            self._since = time.monotonic()
            self.release.wait()
            raise ReplicaBrokenError("tensor-parallel group failed: the peer's collective timed out at last")
        return self.inner.launch(desc)

    def wait(self, out) -> None:
        self.inner.wait(out)

    def keepalive(self) -> None:
        pass

    def stuck_for(self) -> float:
        return 0.0 if self._since is None else time.monotonic() - self._since


def test_watchdog_fails_a_replica_whose_step_blocks_on_the_host(ray_cluster, qwen3_path):
    limit = 2.0
    config = ReplicaConfig(
        engine=EngineConfig(model_path=str(qwen3_path), page_size=4),
        scheduler=SchedulerConfig(),
        collective_timeout_s=limit,
    )
    actor = SchedulerActor(config)
    actor.start()
    hanging = _HangingExecutor(actor.executor)
    actor.scheduler.executor = hanging
    ended: list[str] = []  # how the replica's request counters saw each request end, one entry per request
    actor.metrics.requests = SimpleNamespace(inc=lambda n, tags: ended.extend([tags["finish_reason"]] * n))
    actor.metrics.failures = SimpleNamespace(inc=lambda n, tags: ended.extend([tags["reason"]] * n))
    threading.Thread(target=actor._watch, args=(hanging,), daemon=True).start()

    seen: list[TokenDelta] = []

    def until_finished(uid: int) -> TokenDelta:
        while True:
            seen.extend(actor.poll(1.0))
            ends = [d for d in seen if d.uid == uid and d.finished]
            if ends:
                return ends[0]

    try:
        assert actor.health() is None
        actor.submit([AddRequest(9, [5, 6, 7], greedy(200, ignore_eos=True))])
        actor.abort([9])  # ended by its client: nothing more may reach it, the failure below neither
        hanging.hang.set()
        start = time.monotonic()
        actor.submit([AddRequest(1, [5, 6, 7], greedy(8))])
        failed = until_finished(1)
        assert failed.finish_reason == "error" and "tensor-parallel group failed" in failed.error
        assert limit <= time.monotonic() - start < 3 * limit
        assert not [d for d in seen if d.uid == 9 and d.error is not None]
        assert "tensor-parallel group failed" in actor.health()  # the router's supervisor replaces it
        actor.submit([AddRequest(2, [5, 6], greedy(2))])  # later requests get the error at once
        assert "tensor-parallel group failed" in until_finished(2).error
        hanging.release.set()  # the stuck step fails at last: the loop fails what it held once more
        for _ in range(2):  # the broken loop drains its inbox, then fails all: twice round it has done both
            actor.scheduler.call_between_steps(lambda: None).result(timeout=30)
    finally:
        hanging.release.set()
        actor.shutdown()
    # the two failed requests counted once each, though the released loop fails request 1 again
    assert sorted(ended) == ["abort", "error", "error"]


def test_tp_step_time_bench_says_where_each_rank_is_when_one_stalls_and_exits_124():
    root = Path(__file__).resolve().parents[1]
    # rank 1 hangs before its 30th launch, so rank 0 waits in that step's first all-reduce
    run = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "tp_step_time.py"),
            "--arch",
            "tiny",
            "--device",
            "cpu",
            "--tp-size",
            "2",
            "--batch",
            "4",
            "--output-len",
            "32",
            "--page-size",
            "16",
            "--timeout-s",
            "5",
            "--inject-stall",
            "1:30",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 124, run.stderr[-3000:]
    assert "rank 0 (pid" in run.stderr and "warming up (batch 4), 30 steps launched" in run.stderr
    assert "rank 1 (pid" in run.stderr and "running the follower loop, 30 steps launched" in run.stderr
    rank0_stack, rank1_stack = run.stderr.split("--- rank 0: Python stacks")[1].split("--- rank 1: Python stacks")
    assert "in all_reduce" in rank0_stack and "in counted" in rank1_stack
