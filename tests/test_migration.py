"""Mid-stream migration without Ray: a continuation (the prompt and the tokens already sent, those marked
as output) run on a fresh scheduler produces exactly the rest of what the undisturbed request produces
(seeded draws, penalties, min_tokens, max_tokens, logprobs, a grammar), and a Generation whose replica
goes away moves its choice to another one, its client seeing one stream, within the limit."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from fixtures import PROMPT_TEXTS
from helpers import checked_llm, encode_all

from cluster import AddRequest, ErrorKind, GrammarSpec, ReplicaDownError, SamplingParams, TokenDelta
from router.replicas.generation import Generation, Timing
from router.replicas.migration import Migration, continuation


def test_a_continuation_is_the_prompt_and_the_sent_tokens_with_those_marked_as_output():
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, prompt_logprobs=2, logprobs=1)
    original = AddRequest(7, [1, 2, 3], params)
    moved = continuation(original, [9, 8], uid=11)
    assert (moved.uid, moved.input_ids, moved.output_len) == (11, [1, 2, 3, 9, 8], 2)
    assert moved.params.seed == 3 and moved.params.max_tokens == 10 and moved.params.logprobs == 1
    assert moved.params.prompt_logprobs is None  # sent with the first token already
    assert original.input_ids == [1, 2, 3]
    again = continuation(original, [], uid=12)  # nothing sent yet: the request itself once more
    assert again.input_ids == [1, 2, 3] and again.output_len == 0 and again.params.prompt_logprobs == 2


def _run(llm, requests: list[AddRequest]) -> dict[int, list[TokenDelta]]:
    """Every delta of requests run on the LLM's own scheduler, by uid."""
    got: dict[int, list[TokenDelta]] = {r.uid: [] for r in requests}
    llm.scheduler.on_output = lambda deltas: [got[d.uid].append(d) for d in deltas if d.uid in got]
    for r in requests:
        llm.scheduler.submit(r)
    while llm.scheduler.has_work:
        llm.scheduler.step()
    return got


SAMPLED = [
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=1.0,
        seed=12,
        max_tokens=24,
        presence_penalty=0.8,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
        min_tokens=20,
        logit_bias={5: 3.0},
    ),
    SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=2.0),
    SamplingParams(temperature=0.8, min_p=0.05, seed=13, max_tokens=24),
]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_continuation_produces_the_rest_of_the_undisturbed_output_exactly(qwen3_path, overlap):
    with checked_llm(qwen3_path, overlap=overlap, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[: len(SAMPLED)])
        originals = [AddRequest(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, SAMPLED))]
        whole = _run(llm, originals)
        for sent in (1, 5, 17):
            moved = [continuation(r, [d.token for d in whole[r.uid][:sent]], uid=100 * sent + r.uid) for r in originals]
            rest = _run(llm, moved)  # the prefix cache holds the prompts: as a replica that saw them would
            for r, m in zip(originals, moved):
                expected, got = whole[r.uid][sent:], rest[m.uid]
                assert [d.token for d in got] == [d.token for d in expected], (r.params, sent)
                assert got[-1].finish_reason == expected[-1].finish_reason
                if r.params.logprobs is not None:
                    assert [d.logprob for d in got] == pytest.approx([d.logprob for d in expected], abs=1e-4)


def test_a_continued_grammar_request_goes_on_from_where_its_output_left_its_grammar(qwen3_path):
    regex = r"(yes|no), because [a-z ]{3,12}\."
    with checked_llm(qwen3_path, page_size=4) as llm:
        ids = encode_all(llm, PROMPT_TEXTS[:1])[0]
        params = SamplingParams(temperature=0.9, seed=5, max_tokens=60, grammar=GrammarSpec("regex", regex))
        original = AddRequest(0, ids, params)
        whole = [d.token for d in _run(llm, [original])[0]]
        assert len(whole) > 4
        rest = _run(llm, [continuation(original, whole[:3], uid=1)])[1]
        assert [d.token for d in rest] == whole[3:] and rest[-1].finish_reason == "stop"
        # a stream whose output its grammar cannot have produced is refused, naming the field
        refused = _run(llm, [continuation(original, [llm.tokenizer.eos_token_id], uid=2)])[2]
        assert refused[-1].error_kind is ErrorKind.INVALID_REQUEST and "grammar" in refused[-1].error


# -- a Generation moving its choice, over scripted replicas -------------------------------------------


class _ScriptedClient:
    """A replica client that answers each request with the tokens `script(request)` gives, then ends it;
    with `fail_after`, it fails the request as a dead replica does after that many tokens instead."""

    def __init__(self, replica_id: int, script, fail_after: int | None = None, drain_after: int | None = None) -> None:
        self.replica_id, self.script, self.fail_after, self.drain_after = replica_id, script, fail_after, drain_after
        self.draining = drain_after is not None
        self.received: list[AddRequest] = []
        self.aborted: list[int] = []

    def submit(self, uid, ids, params, after=None, queue=None, output_len=0, on_sent=None):
        queue = asyncio.Queue() if queue is None else queue
        request = AddRequest(uid, list(ids), params, after=after, output_len=output_len)
        self.received.append(request)
        tokens = self.script(request)
        for k, token in enumerate(tokens):
            if self.fail_after is not None and k == self.fail_after:
                queue.put_nowait(TokenDelta.failure(uid, ErrorKind.REPLICA_DOWN, f"replica {self.replica_id} failed"))
                return queue
            if k == self.drain_after:  # a drain's notice; the replica serves on
                why = f"replica {self.replica_id} was drained"
                queue.put_nowait(TokenDelta(uid, None, error=why, error_kind=ErrorKind.REPLICA_DOWN))
            last = k == len(tokens) - 1
            queue.put_nowait(TokenDelta(uid, token, finished=last, finish_reason="length" if last else None))
        return queue

    def abort(self, uid: int) -> None:
        self.aborted.append(uid)


class _Detok:
    stopped = False

    def add(self, token: int, ends: bool = False) -> str:  # no token here is a stop token
        return f"<{token}>"

    def flush(self) -> str:
        return ""


def _tokens_after(request: AddRequest, prompt_len: int, total: int) -> list[int]:
    """The tokens a deterministic replica produces: output position p is token 100 + p."""
    done = len(request.input_ids) - prompt_len
    return [100 + p for p in range(done, total)]


def _generate(clients: list, fail_first: int | None, max_migrations: int, total: int = 8, drain_first=None):
    prompt = [1, 2, 3]
    script = lambda r: _tokens_after(r, len(prompt), total)  # noqa: E731
    first = _ScriptedClient(0, script, fail_after=fail_first, drain_after=drain_first)
    others = [_ScriptedClient(i + 1, script, fail_after=f) for i, f in enumerate(clients)]
    route = iter(others)
    moved: list[str] = []
    migration = Migration(max_migrations, lambda request, failed: next(route, None), itertools.count(50).__next__)
    migration.counted = moved.append
    params = SamplingParams(temperature=0.0, max_tokens=total)

    async def collect() -> str:
        g = Generation(first, [AddRequest(0, prompt, params)], [_Detok()], Timing(), migration)
        return "".join([piece.text async for piece in g])

    return first, others, moved, collect


def test_a_choice_whose_replica_dies_continues_on_another_and_its_stream_is_whole():
    first, others, moved, collect = _generate([None], fail_first=3, max_migrations=2)
    text = asyncio.run(collect())
    assert text == "".join(f"<{100 + p}>" for p in range(8))
    (request,) = others[0].received
    assert request.input_ids == [1, 2, 3, 100, 101, 102] and request.output_len == 3
    assert moved == ["replica_down"]


def test_a_choice_moved_as_often_as_the_limit_allows_fails_with_a_clear_error():
    _, others, _, collect = _generate([2, None], fail_first=3, max_migrations=1)
    with pytest.raises(ReplicaDownError, match="max_migrations"):
        asyncio.run(collect())
    assert not others[1].received


def test_a_choice_with_no_replica_left_fails_as_its_replica_did():
    _, _, moved, collect = _generate([], fail_first=3, max_migrations=2)
    with pytest.raises(ReplicaDownError, match="replica 0 failed; no other replica could take it over"):
        asyncio.run(collect())
    assert not moved


def test_with_migration_off_a_choice_fails_with_its_replica():
    _, others, _, collect = _generate([None], fail_first=3, max_migrations=0)
    with pytest.raises(ReplicaDownError, match="^replica 0 failed$"):
        asyncio.run(collect())
    assert not others[0].received


def test_a_drained_choice_moves_at_the_notice_and_what_its_replica_sent_after_it_is_dropped():
    first, others, moved, collect = _generate([None], fail_first=None, max_migrations=1, drain_first=3)
    assert asyncio.run(collect()) == "".join(f"<{100 + p}>" for p in range(8))
    assert others[0].received[0].output_len == 3 and first.aborted == [0] and moved == ["drained"]


def test_a_drained_choice_that_may_not_move_runs_to_its_end_where_it_is():
    first, others, moved, collect = _generate([None], fail_first=None, max_migrations=0, drain_first=3)
    assert asyncio.run(collect()) == "".join(f"<{100 + p}>" for p in range(8))
    assert not others[0].received and not first.aborted and not moved


def test_the_router_seeds_a_sampled_request_that_has_no_seed_so_a_moved_stream_draws_on_the_same():
    from types import SimpleNamespace

    from cluster import ServeConfig
    from router.http.serving import _choices
    from router.http.state import RequestIds

    def first_seed(params: SamplingParams, max_migrations: int = 2) -> int | None:
        state = SimpleNamespace(uids=RequestIds(), config=ServeConfig().override(max_migrations=max_migrations))
        return _choices(state, [1, 2], params)[0].params.seed

    assert first_seed(SamplingParams(temperature=0.8)) is not None
    assert first_seed(SamplingParams(temperature=0.8, seed=4)) == 4
    assert first_seed(SamplingParams(temperature=0.0)) is None  # greedy draws nothing
    assert first_seed(SamplingParams(temperature=0.8), max_migrations=0) is None  # as before: the replica's
