"""What a replica's model allows a request, checked in one place with one set of messages: by the
router before it sends a request (a 400 naming the field) and by the scheduler when one arrives (the
offline LLM's errors)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import InvalidRequestError
from cluster.sampling_params import SamplingParams


def held_back_ids(params: SamplingParams, eos_ids: frozenset[int] | set[int]) -> list[int]:
    """The tokens that would end a request's output, which min_tokens holds back: EOS (unless ignored)
    and its stop ids, each once (a repeated id would take another entry of the device's table)."""
    eos = [] if params.ignore_eos else sorted(eos_ids)
    return eos + [t for t in dict.fromkeys(params.stop_token_ids) if t not in eos_ids or params.ignore_eos]


@dataclass(frozen=True)
class RequestLimits:
    max_seq_len: int
    vocab_size: int | None = None  # None: token ids are not checked
    max_logit_bias: int | None = None  # the device's per-request table of biased and held-back ids; None: unchecked
    eos_ids: frozenset[int] = frozenset()
    max_prompt_tokens: int | None = None  # a server's own bound, below the context

    def check(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError, naming the field, for a request this model can never run."""
        self.check_prompt(len(input_ids))
        self.check_token_ids(input_ids)
        self.check_params(params)

    def check_token_ids(self, input_ids: list[int]) -> None:
        """Every prompt token inside the vocabulary: an id past the embedding table would fail the step
        that reads it (on a GPU, an out-of-bounds read), and with it every request of that step."""
        if self.vocab_size is None or not input_ids:
            return
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            bad = next(t for t in input_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(
                f"prompt token id {bad} is outside this model's vocabulary (ids 0 to {self.vocab_size - 1})",
                field="prompt",
            )

    def check_prompt(self, n: int) -> None:
        if n == 0:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        limit = min(self.max_prompt_tokens or self.max_seq_len, self.max_seq_len - 1)
        if n > limit:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; at most {limit} are accepted (this model's "
                f"context is {self.max_seq_len} tokens, which must hold the prompt and at "
                f"least one new token)",
                field="prompt",
                code="context_length_exceeded",
            )

    def check_params(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if vocab is not None and (bad := [t for t in params.logit_bias if not 0 <= t < vocab]):
            raise InvalidRequestError(
                f"logit_bias names token {bad[0]}, outside this model's vocabulary (ids 0 to {vocab - 1})",
                field="logit_bias",
            )
        # min_tokens holds stop ids back through the same per-row table as logit_bias
        if vocab is not None and (bad := [t for t in params.stop_token_ids if not 0 <= t < vocab]):
            raise InvalidRequestError(
                f"stop_token_ids names token {bad[0]}, outside this model's vocabulary (ids 0 to {vocab - 1})",
                field="stop_token_ids",
            )
        if (
            vocab is not None
            and params.allowed_token_ids
            and (bad := [t for t in params.allowed_token_ids if not 0 <= t < vocab])
        ):
            raise InvalidRequestError(
                f"allowed_token_ids names token {bad[0]}, outside this model's vocabulary (ids 0 to {vocab - 1})",
                field="allowed_token_ids",
            )
        if vocab is not None and params.min_tokens:
            self.check_held_back(params, vocab)
        if self.max_logit_bias is not None and params.uses_processors:
            stops = len(held_back_ids(params, self.eos_ids)) if params.min_tokens else 0
            if len(params.logit_bias) + stops > self.max_logit_bias:
                raise InvalidRequestError(
                    f"logit_bias names {len(params.logit_bias)} tokens"
                    + (f" and min_tokens holds back {stops} stop tokens" if stops else "")
                    + f"; at most {self.max_logit_bias} are allowed (the max_logit_bias setting)",
                    field="logit_bias",
                )

    def check_held_back(self, params: SamplingParams, vocab: int) -> None:
        """Some token left to sample while min_tokens bans the stop tokens: with none, the sampler drew a
        banned token and the output ended at its first token, as if stopped (a grammar's case is refused
        as it comes, in the scheduler)."""
        held = sum(0 <= t < vocab for t in held_back_ids(params, self.eos_ids))
        if held >= vocab:
            raise InvalidRequestError(
                f"stop_token_ids (with EOS) name all {vocab} tokens of this model's vocabulary, which "
                f"min_tokens ({params.min_tokens}) holds back: no token is left to sample; lower min_tokens "
                "or name fewer stop tokens",
                field="stop_token_ids",
            )
