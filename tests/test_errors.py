"""Failures keep their kind across the replica boundary: the same exception offline at every
tensor-parallel size, the status and OpenAI error type from one table over HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers import fail_first_launch, greedy, serving

from cluster import (
    LLM,
    AddRequest,
    EngineError,
    ErrorKind,
    GenerationError,
    InvalidRequestError,
    RaylmError,
    ReplicaDownError,
    error_for,
)
from cluster.messages import TokenDelta
from router.chat.detokenizer import IncrementalDetokenizer
from router.http.errors import STATUS_OF_KIND, APIError
from router.replicas.generation import Generation, Timing

C = "/v1/completions"
# 8 pages of 4 tokens: a request for 100 new tokens can never fit, whatever else runs
SMALL_CACHE = dict(num_pages=8, page_size=4)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_one_exception_and_one_http_status(kind):
    error = error_for(kind, "why")
    assert isinstance(error, RaylmError) and error.kind is kind and str(error) == "why"
    api = APIError.of(error)
    assert (api.status, api.type) == STATUS_OF_KIND[kind]
    assert 400 <= api.status < 600 and api.body()["error"]["message"] == "why"


def test_statuses_of_the_kinds_a_client_acts_on():
    assert STATUS_OF_KIND[ErrorKind.INVALID_REQUEST][0] == 400
    assert STATUS_OF_KIND[ErrorKind.ENGINE] == (500, "server_error")
    assert STATUS_OF_KIND[ErrorKind.REPLICA_DOWN][0] == 503
    assert STATUS_OF_KIND[ErrorKind.TIMEOUT][0] == 408
    assert STATUS_OF_KIND[ErrorKind.OVERLOADED][0] == 429


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_request_that_can_never_fit_the_cache_raises_invalid_request_at_every_tp(ray_cluster, qwen3_path, tp_size):
    with LLM(str(qwen3_path), tp_size=tp_size, **SMALL_CACHE) as llm:
        with pytest.raises(InvalidRequestError, match="KV-cache pages") as e:
            llm.generate([[5, 6, 7]], greedy(100))
        assert e.value.field == "max_tokens"  # the field at fault, from a replica actor too
        assert len(llm.generate([[5, 6, 7]], greedy(4, ignore_eos=True))[0].token_ids) == 4  # still serves
        llm.check_integrity()


def test_a_request_that_can_never_fit_the_cache_is_a_400_over_http(ray_cluster, qwen3_path):
    with serving(qwen3_path, **SMALL_CACHE) as srv:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100}
        r = httpx.post(srv.url + C, json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "KV-cache pages" in error["message"]
        assert error["param"] == "max_tokens"  # the replica's field at fault crosses to the client
        with httpx.stream("POST", srv.url + C, json={**body, "stream": True}, timeout=60) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["type"] == "invalid_request_error"
        ok = httpx.post(srv.url + C, json={**body, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_an_engine_failure_in_a_step_is_an_engine_error_offline(qwen3_path):
    with LLM(str(qwen3_path)) as llm:
        fail_first_launch(llm.scheduler.executor)
        with pytest.raises(EngineError, match="injected kernel failure") as caught:
            llm.generate([[5, 6, 7]], greedy(4))
        assert isinstance(caught.value, GenerationError) and caught.value.kind is ErrorKind.ENGINE
        assert len(llm.generate([[5, 6, 7]], greedy(4, ignore_eos=True))[0].token_ids) == 4
        llm.check_integrity()


def test_offline_prompts_of_token_ids_take_any_integers_and_refuse_the_rest(qwen3_path):
    import numpy as np

    with LLM(str(qwen3_path)) as llm:
        plain = llm.generate([[5, 6, 7]], greedy(4))[0].token_ids
        assert llm.generate([np.array([5, 6, 7])], greedy(4))[0].token_ids == plain
        assert llm.generate([[5, np.int32(6), 7]], greedy(4))[0].token_ids == plain
        for bad in ([5, True, 7], [5, 6.0, 7], [5, "6", 7]):
            with pytest.raises(InvalidRequestError, match="a prompt's token ids are ints, not (bool|float|str)$"):
                llm.generate([bad], greedy(4))
        llm.check_integrity()


def test_offline_sampling_parameters_may_be_a_dict_of_their_fields(qwen3_path):
    with LLM(str(qwen3_path)) as llm:
        plain = llm.generate([[5, 6, 7]], greedy(4))[0].token_ids
        as_dict = {"max_tokens": 4, "temperature": 0.0}
        assert llm.generate([[5, 6, 7]], as_dict)[0].token_ids == plain
        assert [r.token_ids for r in llm.generate([[5, 6, 7], [5, 6, 7]], [as_dict, greedy(4)])] == [plain, plain]
        with pytest.raises(InvalidRequestError, match="no field 'max_new_tokens'") as caught:
            llm.generate([[5, 6, 7]], {"max_new_tokens": 4})
        assert caught.value.field == "max_new_tokens"
        with pytest.raises(InvalidRequestError, match="a SamplingParams or a dict of its fields, not str"):
            llm.generate([[5, 6, 7]], "greedy")
        llm.check_integrity()


class _FailingClient:
    """A replica client whose replica went down after the request was sent."""

    def submit(self, uid, ids, params, on_sent=None):
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(TokenDelta.failure(uid, ErrorKind.REPLICA_DOWN, "replica 0 failed: ActorDiedError"))
        return queue

    def abort(self, uid):
        pass


def test_a_replica_going_down_reaches_the_router_as_replica_down(qwen3_path):
    from cluster.model_info import load_tokenizer

    detok = IncrementalDetokenizer(load_tokenizer(str(qwen3_path)), [])

    async def run():
        async for _ in Generation(_FailingClient(), [AddRequest(0, [5, 6], greedy(4))], [detok], Timing()):
            pass

    with pytest.raises(ReplicaDownError, match="ActorDiedError") as caught:
        asyncio.run(run())
    assert APIError.of(caught.value).status == 503


def test_a_fault_of_the_routers_own_mid_stream_ends_it_with_an_error_event_not_a_cut_connection():
    """Whatever the router itself fails at while a stream runs (once: a call's number a Decimal could not
    hold) is a server_error event and [DONE], and the request still ends (its pieces closed, counted)."""
    from types import SimpleNamespace

    from router.http.responses import Formatter
    from router.http.serving import _stream
    from router.replicas.generation import Piece

    class Broken(Formatter):
        def chunk_sse(self, piece):
            raise ArithmeticError("a bug")

    async def pieces():
        yield Piece("Hello", [1])
        yield Piece(" there", [2], finish_reason="stop")

    ended, reasons = [], []

    async def finish():
        ended.append(True)

    async def run() -> list[str]:
        state = SimpleNamespace(config=SimpleNamespace(request_timeout_s=None))
        fmt = Broken("id", "m", True, None, None)
        events = _stream(state, pieces(), fmt, 1, False, [], reasons.append, finish)
        return [e async for e in events]

    events = "".join(asyncio.run(run())).split("\n\n")
    error = json.loads(next(e for e in events if "error" in e).removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == 500 and "ArithmeticError" in error["message"]
    assert "data: [DONE]" in events and ended == [True] and reasons == ["error"]
