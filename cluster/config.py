"""Scheduler configuration; the one place that reads the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from worker.config import EngineConfig


def overlap_from_env(default: bool) -> bool:
    """RAYLM_OVERLAP=0 turns the overlap loop off everywhere (for ablations)."""
    value = os.environ.get("RAYLM_OVERLAP")
    return default if value is None else value not in ("0", "false", "False", "off")


@dataclass
class SchedulerConfig:
    cache_type: str = "radix"       # radix (prefix sharing) or naive
    max_extend_tokens: int = 8192   # prompt tokens per prefill step; longer prompts are chunked
    overlap: bool = True            # launch step N+1 before handling step N's results
    # KV pages for up to this many new tokens are set aside when a request is admitted; one that
    # outgrows them takes free pages, and when none are left the newest request is preempted (its
    # pages go to the prefix cache) and recomputed later. A request whose max_tokens fits is never
    # preempted.
    decode_reserve_tokens: int = 1024


@dataclass
class ReplicaConfig:
    """One replica: a scheduler (tensor-parallel rank 0) and tp_size - 1 followers."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    tp_size: int = 1
    collective_timeout_s: float = 60.0  # a collective stalled this long (a dead rank) fails the replica
    placement_strategy: str = "STRICT_PACK"  # PACK lets a replica span nodes
    model_name: str | None = None       # the served name, for metric tags
    log_level: str = "INFO"


@dataclass
class ServeConfig:
    """Everything `launch.py` needs: loaded from a YAML file in configs/, then overridden by flags."""

    model: str = ""
    served_model_name: str | None = None  # the id clients send as "model"; default: the folder's name
    tp_size: int = 1
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None        # a Ray cluster to join ("auto"); None starts a local one
    routing: str = "cache_aware"      # cache_aware or round_robin
    # engine
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    max_running_reqs: int = 256
    max_seq_len: int | None = None
    load_format: str = "auto"
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.85
    cuda_graph_max_bs: int = 256
    # scheduler
    cache_type: str = "radix"
    max_extend_tokens: int = 8192
    overlap: bool = True
    decode_reserve_tokens: int = 1024
    collective_timeout_s: float = 60.0
    placement_strategy: str = "STRICT_PACK"
    # limits and access
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int | None = None  # None: the model's context
    max_tokens_limit: int | None = None   # the most max_tokens a request may ask for; None: the context
    max_stop_strings: int = 16
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    health_check_timeout_s: float = 30.0  # a replica silent this long is replaced (a dead one at once)
    log_level: str = "INFO"

    @classmethod
    def from_yaml(cls, path: str) -> ServeConfig:
        import yaml
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        return cls().override(**data)

    def override(self, **values) -> ServeConfig:
        """A copy with the given fields set; unknown names are an error that names them."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(unknown)}")
        return replace(self, **values)

    def validate(self) -> None:
        if not self.model:
            raise ValueError("no model given: pass --model PATH (or --demo)")
        if self.tp_size < 1 or self.replicas < 1:
            raise ValueError("tp_size and replicas must be at least 1")
        if self.routing not in ("cache_aware", "round_robin"):
            raise ValueError(f"routing must be cache_aware or round_robin, not {self.routing!r}")
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be at least 0, not {self.decode_reserve_tokens}")
        if self.cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type must be radix or naive, not {self.cache_type!r}")

    def replica_config(self) -> ReplicaConfig:
        engine = EngineConfig(
            model_path=self.model, dtype=self.dtype, device=self.device, page_size=self.page_size,
            num_pages=self.num_pages, max_running_reqs=self.max_running_reqs, max_seq_len=self.max_seq_len,
            load_format=self.load_format, attention_backend=self.attention_backend,
            gpu_memory_utilization=self.gpu_memory_utilization, cuda_graph_max_bs=self.cuda_graph_max_bs)
        scheduler = SchedulerConfig(cache_type=self.cache_type, max_extend_tokens=self.max_extend_tokens,
                                    overlap=overlap_from_env(self.overlap),
                                    decode_reserve_tokens=self.decode_reserve_tokens)
        return ReplicaConfig(engine, scheduler, self.tp_size, self.collective_timeout_s, self.placement_strategy,
                             self.served_model_name or Path(self.model).name, self.log_level)
