"""A step that rank 0 fails at tp=2: its own failure before the followers were sent the step fails only
that step's requests, as at tp=1, and the group serves on in step; a failure after they were sent it
breaks the replica (the group would be out of step), as a failure of the group itself does."""

from __future__ import annotations

import pytest
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy

from cluster import LLM
from cluster.errors import EngineError, ReplicaDownError


def _fail_rank0_once(llm: LLM, where: str) -> None:
    """Makes rank 0's next step raise, either at the start of its forward (before any collective) or
    in its LM head, after the step's layers (and their all-reduces) ran on every rank."""

    def inject(actor, where=where):
        engine = actor.engine
        target, name = (engine, "forward") if where == "forward" else (engine.model, "compute_logits")
        real = getattr(target, name)

        def fail_once(*args, **kw):
            setattr(target, name, real)
            raise RuntimeError("injected kernel failure")

        setattr(target, name, fail_once)

    import ray

    ray.get(llm.replica.actor.__ray_call__.remote(inject))


def test_tp2_rank0_failing_before_any_collective_fails_only_that_step(ray_cluster, qwen3_path):
    with checked_llm(qwen3_path, tp_size=2, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        _fail_rank0_once(llm, "forward")
        with pytest.raises(EngineError, match="injected kernel failure"):
            llm.generate(prompts, greedy(8))
        # the same replica serves on, both ranks still in step
        outs = llm.generate(prompts, greedy(8))
        assert [o.token_ids for o in outs] == hf_greedy(qwen3_path, prompts, 8)


def test_tp2_rank0_failing_after_its_followers_got_the_step_breaks_the_replica(ray_cluster, qwen3_path):
    llm = LLM(str(qwen3_path), tp_size=2, page_size=4, collective_timeout_s=10)
    try:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        _fail_rank0_once(llm, "lm_head")
        with pytest.raises(ReplicaDownError, match="out of step"):
            llm.generate(prompts, greedy(8))
    finally:
        llm.shutdown()
