"""The configuration tree, one default per setting: a ReplicaConfig (what `LLM(...)` takes) holds an
EngineConfig and a SchedulerConfig; a ServeConfig (what `launch.py` takes) is a ReplicaConfig plus the
fleet, the HTTP server and its limits. Flags, YAML keys and `LLM` keywords are the leaf fields' names,
flat (`page_size`, not `engine.page_size`), and every value is checked against its field's setting()
before anything starts. `python -m cluster.config` prints the README's table of them."""

from __future__ import annotations

import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from worker.config import EAGLE3_ARCHITECTURES, EngineConfig, setting
from worker.model_context import sliding_window_of

GROUPS = ("engine", "scheduler", "cluster", "server", "limits and access")
CORES_PER_ROUTER = 8  # the default router count leaves a node this many cores for each router actor
LIMITS = "limits and access"
C = TypeVar("C", bound="ReplicaConfig")
_MLP_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def _check_model_values(hf_config: object, model: str) -> None:
    """The config.json values the checks below divide by or compare with: a ConfigError naming the value,
    where a traceback would follow."""
    if not isinstance(hf_config, dict):
        raise ConfigError("model", f"{model}: its config.json is no JSON object but a {type(hf_config).__name__}")
    for key, least in (("num_attention_heads", 1), ("num_key_value_heads", 1), ("max_position_embeddings", 1)):
        value = hf_config.get(key)
        if value is not None and (type(value) is not int or value < least):
            raise ConfigError("model", f"{model}: its config.json's {key} is {value!r}, not a positive integer")
    for key in _MLP_WIDTHS:
        value = hf_config.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ConfigError("model", f"{model}: its config.json's {key} is {value!r}, not an integer >= 0")


def _attention_window(folder: Path, hf_config: dict) -> int | None:
    """The model's attention window as the engine reads it: through transformers' config class, which applies
    each family's rules (Qwen's use_sliding_window and max_window_layers, Mistral's default window); the raw
    config.json's where transformers cannot read it (loading it says why)."""
    from transformers import AutoConfig

    try:
        return sliding_window_of(AutoConfig.from_pretrained(str(folder)))
    except (ValueError, OSError):
        return sliding_window_of(hf_config)


def _has_dense_mlp(hf_config: dict) -> bool:
    """Whether some layer of the model runs a dense MLP of `intermediate_size`: every layer of a dense model,
    and the layers of a Qwen mixture of experts that `mlp_only_layers` / `decoder_sparse_step` leave dense
    (worker/models/qwen_moe.py is_sparse). Mixtral's `intermediate_size` is its experts' width."""
    # the count as published (num_experts), or as transformers 5 saves it (num_local_experts)
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts or not hf_config.get("moe_intermediate_size"):
        return True
    step = hf_config.get("decoder_sparse_step") or 1
    dense = set(hf_config.get("mlp_only_layers") or [])
    return any(i in dense or (i + 1) % step for i in range(hf_config.get("num_hidden_layers", 0)))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's CPU set narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ConfigError(ValueError):
    """A setting with a value it does not allow; `key` is its flat name, `problem` what is wrong."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem


class UnknownSettingError(ConfigError, TypeError):
    """A name that is no setting (a TypeError too, as for any unexpected keyword argument)."""


@dataclass
class SchedulerConfig:
    cache_type: str = setting(
        "radix", "radix: prompts with a common prefix share KV pages; naive: never shared", choices=("radix", "naive")
    )
    max_extend_tokens: int = setting(
        8192,
        "tokens computed per step: prompt chunks and, in a mixed step, one per "
        "running decode; longer prompts are chunked",
        at_least=1,
    )
    mixed_steps: bool = setting(
        True,
        "a step carries every running decode beside the prompt chunks that fit, so "
        "no decode waits for a prompt; off: a step prefills or decodes, prefill first",
    )
    overlap: bool = setting(
        True,
        "the overlap loop: launch step N+1 before handling step N's results (a step that ends a prompt while "
        "at most 4 requests are live is handled first, so its first tokens do not wait for the next launch)",
    )
    # a request whose max_tokens fits its reservation is never preempted
    decode_reserve_tokens: int = setting(
        1024,
        "KV set aside per request at admission for new tokens; a request that outgrows it takes free "
        "pages, and when none are left the lowest-priority, then newest, such request is preempted and "
        "recomputed later",
        at_least=0,
    )
    grammar_compile_timeout_s: float = setting(
        60.0,
        "a constrained request (a JSON schema, regex, grammar or choices) whose grammar has not compiled in "
        "this long fails with 400; its compile goes on, and a later request with the same grammar finds it "
        "compiled. Grammars compile on 4 threads beside the steps (and more than 64 `bad_words` are tokenized "
        "on a thread of their own, under the same limit)",
        above=0,
    )
    # the router refuses at these bounds too, before it sends a request (and tries another replica)
    max_queued_requests: int | None = setting(
        None,
        "requests waiting for their prefill, per replica; more are refused with 429 (offline: OverloadedError)",
        at_least=1,
        unset="unbounded",
    )
    max_queued_tokens: int | None = setting(
        None,
        "prompt tokens of the requests waiting for their prefill, per replica; a request that would pass it "
        "is refused with 429, unless the queue is empty",
        at_least=1,
        unset="unbounded",
    )
    speculative_method: str | None = setting(
        None,
        "speculative decoding: proposed tokens verified in one step, greedy outputs unchanged and sampled ones "
        "keeping their distribution. ngram proposes the tokens that followed an earlier occurrence of a "
        "request's last few tokens (prompt lookup); draft, a smaller model's continuation, drawn as the "
        "model draws (speculative_model); eagle3, an EAGLE-3 draft head (speculative_model: its folder as "
        "published) reading the model's hidden states at three of its layers. Every request speculates, "
        "within its grammar, penalties and biases",
        choices=("ngram", "draft", "eagle3"),
        unset="off",
    )
    speculative_model: str | None = setting(
        None,
        "draft: a local model folder with the model's tokenizer (its vocabulary); eagle3: the head's folder "
        "(config.json and safetensors as published). Run on rank 0's device with a KV cache of as many pages "
        "as the model's (the memory budget counts both, and an EAGLE-3 head's hidden states)",
        unset="none",
    )
    num_speculative_tokens: int = setting(
        4, "tokens proposed per speculating request and step (with speculative_method)", at_least=1, at_most=32
    )
    speculative_max_batch: int = setting(
        32,
        "decode steps of more requests than this verify no proposals (at large batches a step is "
        "compute-bound: verifying k more tokens a request costs more than the tokens it saves)",
        at_least=1,
    )
    speculative_ngram_max: int = setting(
        4,
        "ngram: the longest suffix of a request's tokens looked up (then shorter ones, down to 1)",
        at_least=1,
        at_most=64,
    )
    speculative_max_pause: int = setting(
        32,
        "a request whose proposals found nothing or were all rejected stops speculating for 2 decode "
        "steps, then 4, 8 ... up to this many as that repeats (it decodes in the overlap loop meanwhile; "
        "a proposal kept ends the pause); 0: it never stops",
        at_least=0,
    )
    speculative_adaptive: bool = setting(
        True,
        "speculation runs only while it measures faster: the decode steps' output tokens a request and "
        "second with it and without it are measured in turn (a few steps each), the faster way kept, the "
        "slower probed again after 16 steps, then twice as many as it keeps losing (up to 1,024); a draft "
        "model reading as many weight bytes a forward as the model is never run. Off: speculation runs "
        "whenever speculative_max_batch allows",
    )
    speculative_pipeline: bool = setting(
        True,
        "ngram and draft, in the overlap loop: a request without penalties, biases or a grammar whose last "
        "verify step kept every proposal launches its next one before the one in flight is known, as if that "
        "kept every proposal too (proposing after the token the lookup, or the draft, expects next); where it "
        "kept fewer, the later row is void and its KV given back. Off (and with eagle3): a speculating "
        "request waits for its result before its next step",
    )


@dataclass
class ReplicaConfig:
    """One replica: a scheduler (tensor-parallel rank 0) and tp_size - 1 followers."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"group": "engine"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={"group": "scheduler"})
    tp_size: int = setting(1, "GPUs per replica (tensor-parallel ranks)", at_least=1, group="cluster")
    collective_timeout_s: float = setting(
        60.0, "a collective stalled this long (a dead rank) fails the replica", above=0, group="cluster"
    )
    placement_strategy: str = setting(
        "STRICT_PACK",
        "Ray placement of a replica's ranks: STRICT_PACK on one node, PACK may span nodes",
        choices=("STRICT_PACK", "PACK"),
        group="cluster",
    )
    served_model_name: str | None = setting(
        None,
        "the id clients send as model, and the replicas' metric tag",
        unset="the model folder's name",
        group="server",
    )
    log_level: str = setting(
        "INFO",
        "log level of every process (DEBUG adds per-step batch statistics)",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        group="server",
    )

    @property
    def model(self) -> str:
        return self.engine.model_path

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def ranks_engine(self) -> EngineConfig:
        """Every rank's engine settings: the engine's, its extend graphs no larger than a step, with room for
        a verify step's decode rows where requests speculate (at most speculative_max_batch of them, each its
        proposals and one more)."""
        s = self.scheduler
        # no step computes more than max_extend_tokens: graphs of more tokens would never replay
        engine = replace(self.engine, extend_graph_tokens=min(self.engine.extend_graph_tokens, s.max_extend_tokens))
        if s.speculative_method is None:
            return engine
        rows = min(engine.max_running_reqs, s.speculative_max_batch) * (s.num_speculative_tokens + 1)
        # a verify step computes at most max_extend_tokens tokens, a sample each
        return replace(engine, max_verify_rows=min(rows, s.max_extend_tokens))

    @property
    def rank0_engine(self) -> EngineConfig:
        """Rank 0's engine settings: every rank's, and the draft model it holds beside it (speculative
        decoding), which its memory budget counts."""
        return replace(self.ranks_engine, draft_model=self.scheduler.speculative_model)

    def override(self: C, **values: Any) -> C:
        """A copy with the given settings (flat names) set, each value checked."""
        known = settings(type(self))
        unknown = [name for name in values if name not in known]
        if unknown:
            raise UnknownSettingError(unknown[0], unknown_problem(unknown[0], known, type(self)))
        changes = {}
        for name, value in values.items():
            known[name].check(value)
            changes[known[name].path] = value
        return _replaced(self, changes)

    def validate(self) -> None:
        """Every value allowed, and a model given."""
        for s in settings(type(self)).values():
            s.check(s.get(self))
        if not self.model:
            raise ConfigError("model", "is required: a local model folder or a Hugging Face id")
        sched = self.scheduler
        if (sched.speculative_method in ("draft", "eagle3")) != (sched.speculative_model is not None):
            raise ConfigError(
                "speculative_model",
                "is the draft model's (or EAGLE-3 head's) folder: give it with speculative_method draft "
                "(or eagle3), and only then",
            )

    def check_against_model(self) -> None:
        """What only the model's config.json can tell: the context and how its layers split across ranks.
        A folder whose config.json cannot be read passes; loading it says why."""
        try:
            hf_config = json.loads((Path(self.model) / "config.json").read_text())
        except (OSError, ValueError):
            return
        _check_model_values(hf_config, self.model)
        if (draft := self.scheduler.speculative_model) is not None:
            self._check_draft(Path(draft), hf_config, self.scheduler.speculative_method == "eagle3")
        context = hf_config.get("max_position_embeddings")
        if context and self.engine.max_seq_len and self.engine.max_seq_len > context:
            raise ConfigError(
                "max_seq_len",
                f"must be at most the model's context of {context} tokens "
                f"(max_position_embeddings), not {self.engine.max_seq_len}",
            )
        # only an explicit max_seq_len can exceed the window (without one the engine serves up to it); reading
        # the window imports transformers and torch, seconds that a launch's other checks do not wait on
        window = _attention_window(Path(self.model), hf_config) if self.engine.max_seq_len else None
        if window is not None and self.engine.max_seq_len > window:
            raise ConfigError(
                "max_seq_len",
                f"must be at most the model's attention window of {window} tokens (sliding_window; windowed "
                "attention is not implemented, so sequences are served up to the window), "
                f"not {self.engine.max_seq_len}",
            )
        heads = hf_config.get("num_attention_heads") or 1
        kv_heads = hf_config.get("num_key_value_heads") or heads
        # the dense MLP's width (where a layer is dense), and a mixture of experts' expert and shared-expert widths
        widths = [
            0 if k == "intermediate_size" and not _has_dense_mlp(hf_config) else hf_config.get(k) or 0
            for k in _MLP_WIDTHS
        ]
        # KV heads split evenly across ranks, or (fewer heads than ranks) each replicated to a whole number of ranks
        kv_split = kv_heads % self.tp_size if self.tp_size <= kv_heads else self.tp_size % kv_heads
        if heads % self.tp_size or any(w % self.tp_size for w in widths) or kv_split:
            named = ", ".join(f"{k} {w}" for k, w in zip(_MLP_WIDTHS, widths) if w)
            raise ConfigError(
                "tp_size",
                f"must divide the model's {heads} attention heads and its MLP widths ({named}), "
                f"and divide or be a multiple of its {kv_heads} KV heads; not {self.tp_size}",
            )

    @staticmethod
    def _check_draft(folder: Path, hf_config: dict, eagle3: bool) -> None:
        try:
            draft = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError("speculative_model", f"must be a local model folder with a config.json: {e}") from None
        archs = draft.get("architectures") or []
        head = any(a in EAGLE3_ARCHITECTURES for a in archs)
        if head != eagle3:
            want = "an EAGLE-3 head (" + " or ".join(EAGLE3_ARCHITECTURES) + ")" if eagle3 else "a model"
            raise ConfigError(
                "speculative_model",
                f"must be {want} with speculative_method {'eagle3' if eagle3 else 'draft'}; {folder} holds {archs}",
            )
        if draft.get("vocab_size") != hf_config.get("vocab_size"):
            raise ConfigError(
                "speculative_model",
                f"must share the model's tokenizer: its vocabulary has {draft.get('vocab_size')} tokens, "
                f"the model's {hf_config.get('vocab_size')}",
            )
        reads = draft.get("target_hidden_size") or draft.get("hidden_size")
        if eagle3 and reads != hf_config.get("hidden_size", reads):
            raise ConfigError(
                "speculative_model",
                f"must be an EAGLE-3 head for this model: it reads hidden states {reads} wide, the model's are "
                f"{hf_config.get('hidden_size')}",
            )

    def replica_config(self) -> ReplicaConfig:
        """The part of this configuration one replica needs, with its served name resolved."""
        own = {f.name: getattr(self, f.name) for f in fields(ReplicaConfig)}
        config = ReplicaConfig(**dict(own, served_model_name=self.model_name))
        if config.engine.cpu_threads is None:
            # Ray starts each rank's process with one thread (OMP_NUM_THREADS for its one CPU): on a CPU
            # the host's cores go to the ranks of as many replicas as the fleet may hold
            ranks = max(self.replicas, self.max_replicas or 0) * self.tp_size
            config = replace(config, engine=replace(config.engine, cpu_threads=max(1, (os.cpu_count() or 1) // ranks)))
        return config


@dataclass
class ServeConfig(ReplicaConfig):
    """Everything `launch.py` needs: loaded from a YAML file in configs/, then overridden by flags."""

    replicas: int = setting(
        1,
        "replicas of the model, each of tp_size GPUs; with a replica range, how many start (held within it)",
        at_least=1,
        group="cluster",
    )
    min_replicas: int | None = setting(
        None,
        "with max_replicas, autoscaling: the fewest replicas the fleet shrinks to",
        at_least=1,
        unset="1 when max_replicas is set",
        group="cluster",
    )
    max_replicas: int | None = setting(
        None,
        "autoscaling: the most replicas the fleet grows to while requests queue",
        at_least=1,
        unset="no autoscaling: replicas stays fixed",
        group="cluster",
    )
    autoscale_queue_per_replica: int = setting(
        4,
        "autoscaling adds a replica while more requests than this wait for their prefill per replica (the "
        "replicas' own queues)",
        at_least=0,
        group="cluster",
    )
    autoscale_queued_tokens_per_replica: int | None = setting(
        None,
        "autoscaling adds a replica also while more prompt tokens than this wait for their prefill per replica",
        at_least=1,
        unset="requests counted only",
        group="cluster",
    )
    autoscale_ttft_target_s: float | None = setting(
        None,
        "autoscaling adds a replica also while a request has waited longer than this for its prefill (its "
        "time to first token will be longer still)",
        above=0,
        unset="no target",
        group="cluster",
    )
    autoscale_up_delay_s: float = setting(
        10.0,
        "autoscaling: how long the queue must stay above that before a replica is added",
        at_least=0,
        group="cluster",
    )
    autoscale_down_delay_s: float = setting(
        120.0,
        "autoscaling: how long nothing may wait and some replica hold no request before one is drained "
        "(its requests finish) and removed",
        at_least=0,
        group="cluster",
    )
    address: str | None = setting(
        None, "a Ray cluster to join (auto: the one this node is part of)", unset="start a local Ray", group="cluster"
    )
    health_check_timeout_s: float = setting(
        30.0, "a replica silent this long is replaced (a dead or broken one at once)", above=0, group="cluster"
    )
    max_migrations: int = setting(
        2,
        "times one request may continue on another replica when its own dies or is drained mid-stream "
        "(its stream goes on unbroken); 0: never, the request fails with its replica",
        at_least=0,
        group="cluster",
    )
    rebalance_on_join: bool = setting(
        True,
        "when a replica joins the routing (the fleet grew, a failed one was replaced, one retiring for "
        "scale-down takes requests again), requests waiting on busier replicas with no token yet move to it",
        group="cluster",
    )
    dashboard: bool = setting(
        True, "the Ray dashboard (on 127.0.0.1) with the local Ray this command starts", group="cluster"
    )
    metrics_export_port: int | None = setting(
        None,
        "where Ray exports the replicas' metrics for Prometheus",
        at_least=1,
        at_most=65535,
        unset="Ray's choice",
        group="cluster",
    )
    host: str = setting("127.0.0.1", "where the API listens; 0.0.0.0 exposes it (set api_key then)", group="server")
    port: int = setting(8000, "the API's port", at_least=1, at_most=65535, group="server")
    routers: int | None = setting(
        None,
        "HTTP ingress processes: N Ray actors (raylm-router-0..N-1, restarted by Ray when they die) sharing the "
        "port on this node; 0 serves from the launching process",
        at_least=0,
        at_most=64,
        unset=f"two per replica, at most one per {CORES_PER_ROUTER} of this node's cores (so 0 on a small machine)",
        group="server",
    )
    routing: str = setting(
        "cache_exact",
        "cache_exact: to the replica whose prefix cache holds the longest "
        "prefix of the prompt (its KV events), unless much busier than the "
        "least loaded, else the less loaded of two at random; cache_aware: "
        "prefix affinity on what the router sent where, with a least-loaded "
        "fallback; round_robin",
        choices=("cache_exact", "cache_aware", "round_robin"),
        group="server",
    )
    tool_call_parser: str = setting(
        "auto",
        "how a chat's tool calls are read from its output: qwen (the tool_call tags of Qwen2.5 and Qwen3), "
        "llama (Llama 3.1's JSON); auto: by the model's model_type (qwen2, qwen3: qwen; llama: llama; "
        "others: none)",
        choices=("auto", "qwen", "llama", "none"),
        group="server",
    )
    reasoning_parser: str = setting(
        "auto",
        "how a chat's reasoning is told from its answer: qwen3 (the think block, returned as "
        "reasoning_content); auto: qwen3 for Qwen3 models, none for others",
        choices=("auto", "qwen3", "none"),
        group="server",
    )
    api_key: str | None = setting(
        None,
        "every /v1 route, /tokenize and /detokenize then require Authorization: Bearer KEY",
        unset="none, open",
        group=LIMITS,
    )
    max_body_bytes: int = setting(4 * 2**20, "largest request body, counted as it arrives", at_least=1, group=LIMITS)
    max_prompt_tokens: int | None = setting(
        None, "longest prompt accepted", at_least=1, unset="the model's context", group=LIMITS
    )
    max_tokens_limit: int | None = setting(
        None, "the most max_tokens a request may ask for", at_least=1, unset="the model's context", group=LIMITS
    )
    max_stop_strings: int = setting(16, "stop strings a request may give", at_least=0, group=LIMITS)
    max_n: int = setting(16, "choices (n) a request may ask for", at_least=1, group=LIMITS)
    max_prompts: int = setting(
        2048,
        "prompts a completions request may list (OpenAI's), times its n: the sequences it runs",
        at_least=1,
        group=LIMITS,
    )
    request_timeout_s: float | None = setting(
        None, "a request taking longer ends with 408", above=0, unset="none", group=LIMITS
    )
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM or Ctrl-C, how long requests in flight may take to finish", at_least=0, group=LIMITS
    )
    header_timeout_s: float = setting(
        10.0,
        "a connection must send a request's headers within this long (a slow or silent client is disconnected)",
        above=0,
        group=LIMITS,
    )
    body_timeout_s: float = setting(
        30.0,
        "a request's body must arrive whole within this long after its headers, else a 408 (a client "
        "that stops sending is cut off)",
        above=0,
        group=LIMITS,
    )
    keep_alive_timeout_s: float = setting(
        30.0, "an idle connection between two requests is closed after this long", above=0, group=LIMITS
    )
    max_connections: int = setting(
        4096, "open connections at once; more are answered 503 and closed", at_least=1, group=LIMITS
    )

    @property
    def num_routers(self) -> int:
        """The router actors to start: `routers`, or by default two per replica (one router process
        delivers less than a replica's offline throughput, two nearly all of it: docs/BENCHMARKS.md), as
        long as this node has the cores for them beside the launching process and Ray."""
        if self.routers is not None:
            return self.routers
        return min(2 * self.initial_replicas, usable_cores() // CORES_PER_ROUTER, 64)

    @property
    def autoscaling(self) -> bool:
        """Whether a replica range was given: the fleet then grows and shrinks within it."""
        return self.max_replicas is not None or self.min_replicas is not None

    @property
    def replica_range(self) -> tuple[int, int]:
        """The fewest and most replicas: (replicas, replicas) without autoscaling."""
        if not self.autoscaling:
            return self.replicas, self.replicas
        return self.min_replicas or 1, self.max_replicas or 0

    @property
    def initial_replicas(self) -> int:
        """How many replicas start: `replicas`, held within the range when there is one."""
        low, high = self.replica_range
        return min(max(self.replicas, low), high)

    def validate(self) -> None:
        """Every value allowed, a model given, and a replica range that holds a replica."""
        super().validate()
        if self.min_replicas is not None and self.max_replicas is None:
            raise ConfigError(
                "max_replicas", f"is required with min_replicas ({self.min_replicas}): the most replicas to grow to"
            )
        tuned = [f.name for f in fields(self) if f.name.startswith("autoscale_") and getattr(self, f.name) != f.default]
        if tuned and self.max_replicas is None:  # they would tune an autoscaler that never runs
            raise ConfigError(
                "max_replicas",
                f"is required with {', '.join(tuned)}: they tune autoscaling, which max_replicas turns on",
            )
        low, high = self.replica_range
        if high < low:
            raise ConfigError("max_replicas", f"must be at least min_replicas ({low}), not {high}")

    @classmethod
    def from_yaml(cls, path: str) -> ServeConfig:
        """A flat mapping of settings (`page_size: 16`); an unknown key or a bad value names the file."""
        import yaml

        with open(path) as f:
            data = yaml.load(f, Loader=_unique_keys_loader()) or {}
        if not isinstance(data, dict):
            raise ConfigError(path, "must be a mapping of settings (page_size: 16, ...)")
        known = settings(cls)
        try:
            return cls().override(**{str(key): _yaml_number(known.get(str(key)), value) for key, value in data.items()})
        except ConfigError as e:
            raise type(e)(f"{path}: {e.key}", e.problem) from None


@dataclass(frozen=True)
class Setting:
    """One leaf of the tree: its flat name, where it sits, its type and what it allows."""

    name: str
    path: tuple[str, ...]
    type: type
    optional: bool
    default: Any
    help: str
    group: str
    choices: tuple | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    unset: str | None = None

    def get(self, config: Any) -> Any:
        for attr in self.path:
            config = getattr(config, attr)
        return config

    @property
    def default_text(self) -> str:
        if self.unset is not None and self.default in (None, ""):
            return self.unset
        if self.type is bool:
            return "true" if self.default else "false"
        return str(self.default)

    def allowed(self) -> str:
        """What a value may be, in words: 'an integer >= 1', 'one of radix, naive'."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}[self.type]
        if self.at_least is not None and self.at_most is not None:
            return f"{kind} from {_num(self.at_least)} to {_num(self.at_most)}"
        bounds = [
            f"{op} {_num(v)}"
            for op, v in ((">=", self.at_least), (">", self.above), ("<=", self.at_most))
            if v is not None
        ]
        return " ".join([kind, " and ".join(bounds)]) if bounds else kind

    def check(self, value: Any) -> None:
        if value is None and self.optional:
            return
        ok = {
            bool: lambda v: isinstance(v, bool),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            str: lambda v: isinstance(v, str) and v != "",
        }[self.type](value)
        ok = ok and (not self.choices or value in self.choices)
        if ok and self.type in (int, float):
            ok = (
                (self.at_least is None or value >= self.at_least)
                and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most)
            )
        if not ok:
            raise ConfigError(self.name, f"must be {self.allowed()}, not {value!r}")


@cache
def settings(cls: type) -> dict[str, Setting]:
    """Every leaf setting of a config class, by flat name, in declaration order."""
    found: dict[str, Setting] = {}
    _collect(cls, (), None, found)
    return found


def _collect(cls: type, path: tuple[str, ...], group: str | None, found: dict[str, Setting]) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        hint, meta = hints[f.name], f.metadata
        if meta.get("setting") is False:  # EngineConfig.kernels: chosen by benchmarks and tests, not users
            continue
        assert "help" in meta or is_dataclass(hint), f"{cls.__name__}.{f.name} is not declared with setting()"
        if is_dataclass(hint):
            _collect(hint, path + (f.name,), meta.get("group", group), found)
            continue
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = next(a for a in args if a is not type(None))
        name = meta.get("name") or f.name
        assert name not in found, f"two settings named {name}"
        found[name] = Setting(
            name,
            path + (f.name,),
            base,
            type(None) in args,
            f.default,
            meta["help"],
            meta.get("group") or group,
            meta["choices"],
            meta["at_least"],
            meta["above"],
            meta["at_most"],
            meta["unset"],
        )


def unknown_problem(name: str, known: dict[str, Setting], cls: type) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    if cls is not ServeConfig and name in settings(ServeConfig):
        return f"is not a setting here: it is one of the server's (launch.py --{name.replace('_', '-')})"
    hint = f"did you mean {' or '.join(close)}?" if close else "see python launch.py --help"
    return f"is not a setting ({hint})"


def _replaced(obj: Any, changes: dict[tuple[str, ...], Any]) -> Any:
    """A copy of a dataclass tree with the values at the given attribute paths replaced."""
    direct = {path[0]: value for path, value in changes.items() if len(path) == 1}
    for head in {path[0] for path in changes if len(path) > 1}:
        inner = {path[1:]: value for path, value in changes.items() if len(path) > 1 and path[0] == head}
        direct[head] = _replaced(getattr(obj, head), inner)
    return replace(obj, **direct)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def markdown_table(cls: type = ServeConfig) -> str:
    """The README's Configure table: every setting, grouped, with its default and meaning."""
    rows = ["| setting | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    for group in GROUPS:
        members = [s for s in settings(cls).values() if s.group == group]
        rows += [f"| **{group}** | | | |"] if members else []
        rows += [f"| `{s.name}` | {s.default_text} | {s.allowed()} | {s.help} |" for s in members]
    return "\n".join(rows)


def _yaml_number(setting: Setting | None, value: Any) -> Any:
    """A number setting's value as written: PyYAML reads YAML 1.1, where `1e-1` (no dot) is a string."""
    if setting is not None and setting.type is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # the setting's check names it
    return value


def _unique_keys_loader():
    """PyYAML's safe loader, refusing a mapping that gives one key twice (it would keep the last, and a
    setting written twice in a serving file is a mistake either way)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):  # a list or mapping as a key: no setting's name
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a key that is a {key_node.id} is not a setting's name", key_node.start_mark
                    )
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


if __name__ == "__main__":
    print(markdown_table())
