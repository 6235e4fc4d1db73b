"""How to sample one request's output, validated where it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.errors import InvalidRequestError


@dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1                 # -1 (or 0) keeps the whole vocabulary
    max_tokens: int | None = 16     # None: up to the context length
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None     # None: none; k >= 0: the sampled token's logprob and the k most likely
    # not a sampling value, but it travels with them: lower runs first (vLLM's meaning), in the waiting
    # queue and when a request is chosen for preemption (the highest number goes first)
    priority: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")
