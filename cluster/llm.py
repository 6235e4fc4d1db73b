"""The offline API: `LLM(path).generate(prompts, params)`. At tp_size 1 the scheduler runs in this
process, with no Ray; at tp_size > 1 it is the same scheduler actor and followers the server uses."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import numbers
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.choices import fan_out
from cluster.config import ReplicaConfig
from cluster.errors import ErrorKind, InvalidRequestError, error_for
from cluster.messages import AddRequest, SchedulerStats, TokenDelta
from cluster.model_info import load_tokenizer, local_model
from cluster.replica.engine_executors import LocalExecutor
from cluster.sampling_params import SamplingParams
from cluster.scheduler.build import build_scheduler
from cluster.text import text_after
from worker.config import EngineConfig
from worker.engine import Engine
from worker.kernels import Kernels


@dataclass
class CompletionOutput:
    """One choice of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # with SamplingParams.logprobs: each output token's
    # with SamplingParams.logprobs k > 0: at each output token, the k most likely (id, logprob), best first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    error_field: str | None = None  # an invalid request's field at fault
    error_code: str | None = None


@dataclass
class RequestOutput:
    """A prompt's result: its choices (`outputs`, n of them); the fields below are the first choice's."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # with SamplingParams.prompt_logprobs: positions 1.. of the prompt, (logprob, [(id, logprob) of the k most likely])
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs


def _token_ids_kind(value: object) -> bool:
    """Whether `value` may be a list of token ids: a sequence, not text of any kind (bytes are a sequence of
    ints, but are text not yet decoded) and not a mapping."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) or _is_array(value)


def _is_array(value: object) -> bool:
    return type(value).__module__ == "numpy" and getattr(value, "ndim", 0) >= 1


def _named(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return "bytes (decode them to a str)"
    return type(value).__name__


def _prompt_list(prompts: object) -> list:
    """generate()'s prompts as a list of prompts: one string or one list of token ids is one prompt; a list,
    tuple or other iterable of them is several."""
    if isinstance(prompts, str):
        return [prompts]
    if _token_ids_kind(prompts):
        if len(prompts) and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool):
            return [prompts]  # one prompt's token ids
        return list(prompts)
    if isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray, Mapping)):
        return list(prompts)  # a generator, say
    raise InvalidRequestError(f"prompts are a string, a list of token ids, or a list of either, not {_named(prompts)}")


class LLM:
    def __init__(self, model: str, *, kernels: Kernels = Kernels(), **settings) -> None:
        """`model`: a local Hugging Face folder or a GGUF file. `settings`: any of ReplicaConfig's, by name
        (page_size=16, tp_size=2, overlap=False, ...: `python -m cluster.config` lists them); a misspelt one is
        an error.
        `kernels`: other kernels than the automatic choices, for benchmarks and tests that compare them."""
        model = local_model(model)
        self.config = ReplicaConfig(engine=EngineConfig(kernels=kernels)).override(model=model, **settings)
        self.config.validate()
        self.config.check_against_model()
        self.tokenizer = load_tokenizer(model)
        self._outputs: dict[int, tuple[RequestOutput, CompletionOutput]] = {}  # by uid: each choice's
        self._uids = itertools.count()
        self.replica = None
        self.scheduler = None
        self._closed = False
        # one generate at a time: the scheduler is driven by the calling thread, and two threads stepping it
        # at once would interleave its steps
        self._lock = threading.Lock()
        if self.config.tp_size > 1:
            from cluster.fleet.deploy import ReplicaHandle, ensure_ray

            ensure_ray()
            self.replica = ReplicaHandle(self.config)
            return
        self.engine = Engine(self.config.rank0_engine)
        self.executor = LocalExecutor(self.engine)
        self.scheduler = build_scheduler(
            self.config, self.engine, self.executor, self.tokenizer, on_output=self._collect
        )

    def _collect(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            if (found := self._outputs.get(d.uid)) is None:
                continue
            request, out = found
            if d.prompt_logprobs is not None:
                request.prompt_logprobs = d.prompt_logprobs
            if d.error is not None:
                out.error, out.error_kind, out.error_field, out.error_code = (
                    d.error,
                    d.error_kind,
                    d.error_field,
                    d.error_code,
                )
            if d.token is not None:
                out.token_ids.append(d.token)
            if d.logprob is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(d.logprob)
            if d.top_logprobs is not None:
                if out.top_logprobs is None:
                    out.top_logprobs = []
                out.top_logprobs.append(d.top_logprobs)
            if d.finished:
                out.finish_reason = d.finish_reason

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | Mapping | list[SamplingParams | Mapping] | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's choices, in order. `params`: one SamplingParams (or a dict of its fields) for
        every prompt, or one a prompt. Calls from several threads run one after another. Ctrl-C during a call
        ends its requests and raises KeyboardInterrupt, the engine ready for the next call."""
        if self._closed:
            raise RuntimeError("this LLM is shut down: make a new one")
        with self._lock:
            return self._generate(prompts, params)

    def _generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | Mapping | list[SamplingParams | Mapping] | None,
    ) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params
        if isinstance(params, (SamplingParams, Mapping)):
            params = [params] * len(prompts)
        params = [_sampling_params(p) for p in params]
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        encoded = [self._encode(prompt) for prompt in prompts]
        if self.scheduler is not None:
            for ids, p in zip(encoded, params):
                self.scheduler.validate(ids, p.for_choice(0))
        results, requests = [], []
        for ids, p in zip(encoded, params):
            choices = fan_out(self._uids, ids, p)
            result = RequestOutput(ids, [CompletionOutput(i) for i in range(len(choices))])
            for r, out in zip(choices, result.outputs):
                self._outputs[r.uid] = (result, out)
            results.append(result)
            requests += choices
        uids = [r.uid for r in requests]
        try:
            if self.replica is not None:
                self._run_remote(requests)
            else:
                with _interrupts_between_steps() as interrupted:
                    for r in requests:
                        self.scheduler.submit(r)
                    aborted = False
                    while self.scheduler.has_work:
                        self.scheduler.step(block=True)  # waits, rather than spins, while only grammars compile
                        if interrupted.is_set() and not aborted:  # the loop then runs until they have ended
                            for uid in uids:
                                self.scheduler.abort(uid)
                            aborted = True
                if aborted:
                    raise KeyboardInterrupt
        finally:
            outputs = [self._outputs.pop(uid)[1] for uid in uids]
        for request, out in zip(requests, outputs):
            if out.error is not None:  # the same exception whether the scheduler ran here or in an actor
                raise error_for(out.error_kind or ErrorKind.ENGINE, out.error, out.error_field, out.error_code)
            if self.tokenizer is not None:
                shown = out.token_ids
                if out.finish_reason == "stop" and shown and shown[-1] in request.params.stop_token_ids:
                    shown = shown[:-1]  # the stop token's text is not the output's, as vLLM's (and EOS's)
                out.text = text_after(self.tokenizer, request.input_ids, shown)
        return results

    def _run_remote(self, requests: list[AddRequest]) -> None:
        import ray

        actor = self.replica.actor
        ray.get(actor.submit.remote(requests))
        pending = {r.uid for r in requests}
        while pending:
            deltas = ray.get(actor.poll.remote(1.0))
            self._collect(deltas)
            pending -= {d.uid for d in deltas if d.finished}

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model folder has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer(prompt).input_ids
        if not _token_ids_kind(prompt):
            raise InvalidRequestError(f"a prompt is a string or a list of token ids (ints), not {_named(prompt)}")
        ids = list(prompt)
        # the types present, not each token through isinstance: an abstract-class check per token cost
        # 0.7 s on the CPU before the first step of 128 prompts of 4,500 tokens
        kinds = set(map(type, ids))
        if kinds <= {int}:
            return ids
        others = sorted(k.__name__ for k in kinds if not issubclass(k, numbers.Integral) or issubclass(k, bool))
        if others:
            raise InvalidRequestError(f"a prompt's token ids are ints, not {', '.join(others)}")
        return [int(t) for t in ids]  # numpy's integers and the like, as the scheduler's plain ints

    def stats(self) -> SchedulerStats:
        """The scheduler's counts (at tp > 1 a ReplicaStats, with the replica's own)."""
        if self.replica is not None:
            import ray

            return ray.get(self.replica.actor.stats.remote())
        return self.scheduler.snapshot()

    def check_integrity(self) -> None:
        if self.replica is not None:
            import ray

            ray.get(self.replica.actor.check_integrity.remote())
        else:
            self.scheduler.check_integrity()

    def shutdown(self) -> None:
        self._closed = True
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None
        elif self.scheduler is not None:
            self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def _interrupts_between_steps() -> Iterator[threading.Event]:
    """While the body runs on the main thread, Ctrl-C (SIGINT) sets the event rather than raising wherever the
    scheduler happens to be: a step cut in the middle would leave its requests half-handled and the next call
    spinning. The caller looks at the event between steps. Elsewhere the event is never set."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _sampling_params(params: object) -> SamplingParams:
    """`params` as SamplingParams: a dict names its fields (one it does not have is the caller's error)."""
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, Mapping):
        raise InvalidRequestError(
            f"sampling parameters are a SamplingParams or a dict of its fields, not {type(params).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown := sorted(str(k) for k in params if k not in fields):
        raise InvalidRequestError(
            f"SamplingParams has no field {unknown[0]!r} (its fields: {', '.join(sorted(fields))})", field=unknown[0]
        )
    return SamplingParams(**params)
