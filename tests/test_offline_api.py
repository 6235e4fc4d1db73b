"""The offline LLM's calls as a program makes them: Ctrl-C in the middle of one, two threads at once, a call
after shutdown. Each leaves the engine whole or says why it cannot run."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest
from helpers import checked_llm

from cluster import LLM, SamplingParams
from cluster.errors import InvalidRequestError
from worker.loader import CheckpointError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


def test_ctrl_c_in_a_generate_ends_its_requests_and_the_next_call_runs(qwen3_path):
    with checked_llm(qwen3_path, num_pages=256) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        collect = llm._collect

        def interrupted_once(deltas):  # Ctrl-C as the first tokens come back
            llm._collect = collect
            os.kill(os.getpid(), signal.SIGINT)
            collect(deltas)

        llm._collect = interrupted_once
        llm.scheduler.on_output = lambda deltas: llm._collect(deltas)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, {**GREEDY.__dict__, "max_tokens": 400})
        assert llm.stats().live == 0  # its requests ended, pages and slots back (checked_llm checks them)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_two_threads_generating_at_once_each_get_their_own_answers(qwen3_path):
    with checked_llm(qwen3_path, num_pages=256) as llm:
        want = [[o.token_ids for o in llm.generate([p], GREEDY)][0] for p in PROMPTS[:2]]
        got: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                got[i] = llm.generate([PROMPTS[i]], GREEDY)[0].token_ids
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and [got[0], got[1]] == want


def test_a_generate_after_shutdown_says_so(qwen3_path):
    with checked_llm(qwen3_path, num_pages=64) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_prompts_of_another_kind_are_one_error_naming_it_and_an_iterable_of_prompts_runs(qwen3_path):
    with checked_llm(qwen3_path, num_pages=64) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
        assert [o.token_ids for o in llm.generate(iter(PROMPTS[:2]), GREEDY)] == want
        assert [o.token_ids for o in llm.generate(tuple(PROMPTS[:2]), GREEDY)] == want
        assert [o.token_ids for o in llm.generate(PROMPTS[0], GREEDY)] == want[:1]  # one prompt's ids alone
        for prompts, named in [
            (None, "not NoneType"),
            (7, "not int"),
            ({"prompt": "Hi"}, "not dict"),
            (b"Hello", "not bytes (decode them to a str)"),  # not its bytes run as token ids
            ([b"Hello"], "not bytes (decode them to a str)"),
            ([None], "not NoneType"),
            ([7, None], "token ids are ints, not NoneType"),
        ]:
            with pytest.raises(InvalidRequestError, match=re.escape(named)):
                llm.generate(prompts, GREEDY)
        assert llm.stats().live == 0


@pytest.mark.parametrize("where", ["missing", "a-file", "no-config"])
def test_a_path_that_is_no_model_folder_is_named_as_launch_names_it(tmp_path, where):
    path = tmp_path / "model"
    if where == "a-file":
        path.write_text("{}")
    elif where == "no-config":
        path.mkdir()
    with pytest.raises(CheckpointError) as e:
        LLM(str(path))
    says = {
        "missing": f"there is no file or folder {path}: give",
        "a-file": f"{path} is a file: give the Hugging Face model folder that holds it",
        "no-config": f"{path} has no config.json",
    }
    assert str(e.value).startswith(says[where]), e.value
