"""Per-request state on rank 0's CPU, advanced at launch (one step ahead of the results handled)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    uid: int
    input_ids: list[int]  # the prompt, then every token received so far
    params: SamplingParams
    max_device_len: int  # prompt length + max_tokens
    seed: int
    prompt_len: int = 0
    cached_len: int = 0  # positions whose KV is written, or will be by launched steps
    device_len: int = 0  # tokens on the device, the in-flight sample included
    slot: int = -1  # request slot; -1 while it has none
    pages: list[int] = field(default_factory=list)  # KV pages covering positions 0.. in order
    num_cached_pages: int = 0  # leading pages owned by the prefix cache (locked through cache_handle)
    cache_handle: object = None
    reserved_pages: int = 0  # pages it may still allocate, set aside at admission
    prefix_hit_len: int = 0  # prompt tokens found in the prefix cache
    fill_len: int = 0  # tokens to prefill: the prompt, or after a preemption all tokens so far
    may_outgrow: bool = False  # its reservation does not cover max_tokens: it may be preempted
    num_preempted: int = 0
    after: Req | None = None  # another choice of the same prompt: admitted once that one's prompt is cached
    # with params.grammar: its xgrammar matcher, once the grammar is compiled; with allowed_token_ids or
    # bad_words: a TokenMaskMatcher (cluster/scheduler/token_set.py)
    matcher: object = None
    speculates: bool = False  # its decode steps may verify proposed tokens
    # a step that verifies proposals for it is in flight: its state is provisional (in speculation's
    # pipeline, the one after that step may verify too: the flag follows the step handled last)
    verifying: bool = False
    # speculation's pipeline (speculative_pipeline): its next verify step may launch while its last one is
    # in flight, as if that one kept every proposal; `tail` holds the tokens its row in flight then adds
    # (the proposals and the token the lookup expects after them), [] with no row in flight that counts
    # (none, or a void one), None where they are unknown (a plain row's sample): it then waits for its
    # result before it speculates again
    pipelines: bool = False
    tail: list[int] | None = field(default_factory=list)
    # whether its last verify step kept every proposal: the pipeline's bet on the step in flight is taken
    # only then (where proposals are lately cut short, it waits instead of launching rows likely void)
    kept_all: bool = True
    # speculation's back-off: decode steps left in which it neither speculates nor waits for its own
    # result (its proposals lately found nothing or were all rejected), and how many times in a row
    spec_pause: int = 0
    spec_misses: int = 0
    reserve_limit: int = 0  # pages its reservation covers, held and reserved together (set at admission)
    ended: bool = False
    # with params.prompt_logprobs: (logprob, top (id, logprob) pairs) of prompt positions 1.., as chunks are scored
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first prefill launch
    prompt_launched: float | None = None  # the launch of its prompt's last chunk returned (the latest such)
    first_token: float | None = None
    last_token: float | None = None

    def __post_init__(self) -> None:
        self.prompt_len = self.fill_len = len(self.input_ids)
        self.device_len = self.prompt_len
        p = self.params
        # whether a step holding it needs more than temperature, top-p and top-k (checked every step)
        self.sampling_extras = p.uses_processors or p.min_p > 0 or p.grammar is not None or p.token_masks

    @property
    def output_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still to be computed: asked for and not sent yet (they go with its first
        token). A request preempted before its first token reached the host (its last prompt chunk in
        flight, whose scores were dropped with that step's result) scores its whole prompt again."""
        return self.params.prompt_logprobs is not None and len(self.input_ids) == self.prompt_len

    @property
    def extend_len(self) -> int:
        """Tokens still to prefill."""
        return self.fill_len - self.cached_len

    @property
    def constrained(self) -> bool:
        """Whether a matcher masks its samples: a grammar's, or its allowed_token_ids' and bad words'."""
        return self.params.grammar is not None or self.params.token_masks

    @property
    def held(self) -> bool:
        """Waits: for its grammar to compile or its token mask to be made, or for the choice it shares a
        prompt with to have that prompt in the prefix cache."""
        if self.constrained and self.matcher is None:
            return True
        if self.after is not None and (self.after.ended or self.after.first_token is not None):
            self.after = None
        return self.after is not None

    @property
    def can_decode(self) -> bool:
        return self.device_len < self.max_device_len
