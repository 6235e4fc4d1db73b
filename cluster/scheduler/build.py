"""A replica's scheduler over a started engine: its cache's size, its limits and its grammars taken from
the engine, the model folder and the settings (the one place a scheduler is built outside tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from cluster.config import ReplicaConfig
from cluster.messages import TokenDelta
from cluster.model_info import eos_token_ids
from cluster.scheduler.draft import DraftProposer, Eagle3Proposer, weight_bytes
from cluster.scheduler.executor import Executor
from cluster.scheduler.grammars import Grammars
from cluster.scheduler.req import Req
from cluster.scheduler.scheduler import Scheduler
from worker.config import EngineConfig
from worker.engine import Engine


def build_scheduler(
    config: ReplicaConfig,
    engine,
    executor: Executor,
    tokenizer,
    on_output: Callable[[list[TokenDelta]], None],
    on_finish: Callable[[Req, str], None] | None = None,
) -> Scheduler:
    """The scheduler of rank 0's `engine` (a worker Engine, started), launching on `executor`;
    `tokenizer`: the model folder's (None: no grammars are served)."""
    eos = eos_token_ids(config.engine.model_path, engine.hf_config, tokenizer)
    draft = None
    method = config.scheduler.speculative_method
    if method in ("draft", "eagle3"):
        # the draft's extend graphs no larger than a step, as the model's (ReplicaConfig.ranks_engine)
        draft_config = replace(
            draft_engine_config(config.engine, config.scheduler.speculative_model, engine),
            extend_graph_tokens=config.ranks_engine.extend_graph_tokens,
        )
        draft_engine = Engine(draft_config, beside=engine if method == "eagle3" else None)
        cost = weight_bytes(draft_engine.model) / max(1, weight_bytes(engine.model))
        if method == "eagle3":
            draft = Eagle3Proposer(draft_engine, engine, cost)
        else:
            draft = DraftProposer(draft_engine, cost)
    vocab = engine.hf_config.vocab_size
    return Scheduler(
        config.scheduler,
        executor,
        num_pages=engine.num_pages,
        page_size=engine.page_size,
        max_running_reqs=config.engine.max_running_reqs,
        max_seq_len=engine.max_seq_len,
        eos_ids=eos,
        on_output=on_output,
        on_finish=on_finish,
        vocab_size=vocab,
        max_logit_bias=config.engine.max_logit_bias,
        grammars=Grammars(tokenizer, vocab, sorted(eos)) if tokenizer is not None else None,
        draft=draft,
        sort_decode_rows=config.engine.kernels.sorts_decode_rows,
    )


def draft_engine_config(target: EngineConfig, folder: str, engine) -> EngineConfig:
    """The draft's engine: the target's settings on rank 0's device and in its dtype, its own weights, and
    as many pages and as long a context as the target's (its request slots are the target's)."""
    device = str(engine.device)
    return replace(
        target,
        model_path=folder,
        device=device,
        # the model's dtype, whatever the draft's config says: an EAGLE-3 head reads the model's hidden
        # states, and a head published in float16 drafts beside a bfloat16 model
        dtype=str(engine.dtype).removeprefix("torch."),
        num_pages=engine.num_pages,
        max_seq_len=engine.max_seq_len,
        draft_model=None,
        drafts=True,
        # the served model's head: a draft's (a bf16 draft beside an FP8 checkpoint has no FP8 weights) stays
        quantize_lm_head=False,
    )
