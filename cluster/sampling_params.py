"""How to sample one request's output, validated where it is made."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from cluster.errors import InvalidRequestError

_PENALTY_RANGE = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
# bounds that keep the float32 sampling arithmetic finite: a larger temperature or repetition_penalty (or
# a smaller penalty) turns logits into infinities or NaN, which no mask or ban then holds
_TEMPERATURE_MAX = 1e4
_REPETITION_RANGE = (1e-4, 1e4)
_SEED_RANGE = (-(2**63), 2**63)  # the device's int64 seeds
_BIAS_RANGE = 100.0  # OpenAI's bound on a logit_bias value
# each field's type, checked before its bounds: a string or None compared with a bound raised TypeError,
# a float count ran as its ceiling (max_tokens=2.5 gave 3 tokens) and a bool passed for 0 or 1
_INTEGERS = ("top_k", "max_tokens", "min_tokens", "n", "seed", "logprobs", "prompt_logprobs", "priority")
_MAY_BE_NONE = frozenset(("max_tokens", "seed", "logprobs", "prompt_logprobs"))
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, compiled by xgrammar (cluster/scheduler/grammars.py) and cached by its value."""

    kind: Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
    # the JSON schema (JSON text), the regular expression, the EBNF grammar or the structural tag (JSON
    # text, xgrammar's format); empty for json_object
    spec: str = ""
    # json_schema and json_object: whether whitespace between JSON tokens is free (xgrammar's any_whitespace);
    # by default none is: one space after each ":" and ",", as json.dumps writes, so a model cannot run
    # into max_tokens writing whitespace
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}", field="response_format"
            )


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # OpenAI's penalties over the generated tokens: a token's logit loses frequency_penalty times its
    # count so far, and presence_penalty once it has appeared
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's (and vLLM's) over the prompt and the generated tokens: a seen token's logit is
    # divided by it when positive, multiplied when negative; 1 is off
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit; -100 bans
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and its k most likely
    n: int = 1  # choices sampled from one prompt (cluster/choices.py fans them out)
    grammar: GrammarSpec | None = None  # the output follows it (and ends once it is complete)
    # vLLM's: only these tokens may be sampled (None: any); not with a grammar
    allowed_token_ids: list[int] | None = None
    # vLLM's: words kept out of the output: each word's last token is masked wherever the output so far ends
    # with its other tokens (cluster/scheduler/token_set.py); not with a grammar
    bad_words: list[str] | None = None
    # not a sampling value, but it travels with them: lower runs first (vLLM's meaning), in the waiting
    # queue and when a request is chosen for preemption (the highest number goes first)
    priority: int = 0

    def __post_init__(self) -> None:
        self._check_types()
        self._check_bounds()

    def _check_types(self) -> None:
        """Raises InvalidRequestError, naming the field, for a value not of its field's type; numpy's
        scalars become Python's. None for stop_token_ids or logit_bias is their default, none."""
        for name in _INTEGERS:
            value = getattr(self, name)
            if value is None and name in _MAY_BE_NONE:
                continue
            if not _integer(value):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)
            setattr(self, name, operator.index(value))
        for name in _NUMBERS:
            value = getattr(self, name)
            if not _finite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", field=name)
            setattr(self, name, float(value))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos")
        if not (self.grammar is None or isinstance(self.grammar, GrammarSpec)):
            raise InvalidRequestError(f"grammar must be a GrammarSpec, got {self.grammar!r}", field="grammar")
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids(self.allowed_token_ids, "allowed_token_ids")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise InvalidRequestError(
                    f"bad_words must be a list of strings, got {self.bad_words!r}", field="bad_words"
                )
            self.bad_words = list(self.bad_words)
        self.logit_bias = _biases(self.logit_bias)

    def _check_bounds(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} {what}, got {getattr(self, name)!r}", field=name)

        need(0 <= self.temperature <= _TEMPERATURE_MAX, "temperature", f"must be in [0, {_TEMPERATURE_MAX:g}]")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(-1 <= self.top_k < 2**31, "top_k", "must be -1 (off) or positive, below 2**31")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1")
        need(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens})",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            need(
                abs(getattr(self, name)) <= _PENALTY_RANGE,
                name,
                f"must be in [-{_PENALTY_RANGE:g}, {_PENALTY_RANGE:g}]",
            )
        low, high = _REPETITION_RANGE
        need(low <= self.repetition_penalty <= high, "repetition_penalty", f"must be in [{low:g}, {high:g}] (1 is off)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            need(k is None or 0 <= k <= 20, name, "must be an integer between 0 and 20")
        need(self.n >= 1, "n", "must be at least 1")
        need(self.allowed_token_ids is None or bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
        for name in ("allowed_token_ids", "bad_words"):
            need(
                getattr(self, name) is None or self.grammar is None,
                name,
                "cannot be combined with a grammar (response_format, guided_*, structured_outputs or strict tools)",
            )
        need(
            self.bad_words is None or all(w.strip() for w in self.bad_words), "bad_words", "must not hold an empty word"
        )
        need(
            self.seed is None or _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1],
            "seed",
            "must be an integer in [-2**63, 2**63)",
        )

    @property
    def uses_processors(self) -> bool:
        """Whether sampling needs the per-request state on the device (penalties, biases, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def token_masks(self) -> bool:
        """Whether its samples are masked without a grammar (allowed_token_ids, bad_words)."""
        return self.allowed_token_ids is not None or bool(self.bad_words)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: one choice, with its own seed."""
        seed = None if self.seed is None else choice_seed(self.seed, index)
        return dataclasses.replace(self, n=1, seed=seed)


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed, derived from the request's: choice 0 keeps it (so n=1 samples as before);
    the others get distinct seeds spread over 62 bits (a splitmix64 step of seed + index)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


def _integer(value: object) -> bool:
    """An integer (a numpy one too), not a bool: True would pass for 1 and then reach the device as one."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) == value
    except TypeError:
        return False


def _finite(value: object) -> bool:
    """A finite real number, not a bool: NaN and the infinities pass no bound as meant."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _token_ids(value: object, name: str = "stop_token_ids") -> list[int]:
    """A list of token ids (stop_token_ids, allowed_token_ids) as ints (None: none); their range is the
    model's (cluster/limits.py)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {type(value).__name__}", field=name)
    if set(map(type, value)) <= {int}:  # the common case, without a check per id
        return list(value)
    if bad := [t for t in value if not _integer(t)]:
        raise InvalidRequestError(f"{name} holds {bad[0]!r}; token ids are integers", field=name)
    return [operator.index(t) for t in value]


def _biases(value: object) -> dict[int, float]:
    """logit_bias with int keys and float values, each in range (None: none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"logit_bias must map token ids to biases, got {type(value).__name__}", field="logit_bias"
        )
    biases = {}
    for token, bias in value.items():
        if not _integer(token) or token < 0:
            raise InvalidRequestError(f"logit_bias has token id {token!r}; ids are integers >= 0", field="logit_bias")
        if not (_finite(bias) and abs(bias) <= _BIAS_RANGE):
            raise InvalidRequestError(
                f"logit_bias of token {token} is {bias!r}; values are in [-{_BIAS_RANGE:g}, {_BIAS_RANGE:g}]",
                field="logit_bias",
            )
        biases[operator.index(token)] = float(bias)
    return biases
