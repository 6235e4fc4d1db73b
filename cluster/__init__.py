"""Control plane: requests, scheduling, replicas on Ray, and the offline `LLM` API. What the router
(and any other caller) uses is exported here; the rest of cluster/ is its own business."""

from cluster.provenance import check_own_packages

check_own_packages()  # before anything imports worker

from cluster.channel import ChannelAddress, ChannelConnection
from cluster.choices import fan_out
from cluster.errors import (
    EngineError,
    ErrorKind,
    GenerationError,
    InvalidRequestError,
    OverloadedError,
    RaylmError,
    ReplicaDownError,
    RequestTimeoutError,
    error_for,
)
from cluster.limits import RequestLimits
from cluster.messages import AddRequest, FirstTokenHops, KVEvents, ReplicaInfo, ReplicaOutput, ReplicaStats, TokenDelta
from cluster.sampling_params import GrammarSpec, SamplingParams
from cluster.scheduler.prefix_cache.events import block_hashes, iter_block_hashes

# loaded on first use: they import torch, Ray or transformers, and cluster.config (which launch.py
# checks its flags with before anything starts) must import in a fraction of a second
_LAZY = {
    "ReplicaConfig": "cluster.config",
    "ServeConfig": "cluster.config",  # lazy too: `python -m cluster.config`
    "LLM": "cluster.llm",
    "RequestOutput": "cluster.llm",
    "CompletionOutput": "cluster.llm",
    "Fleet": "cluster.fleet.fleet",
    "AutoscalePolicy": "cluster.fleet.autoscale",
    "AutoscaleSettings": "cluster.fleet.autoscale",
    "ReplicaLoad": "cluster.fleet.autoscale",
    "FleetMetrics": "cluster.fleet.fleet_metrics",
    "ReplicaHandle": "cluster.fleet.deploy",
    "ensure_ray": "cluster.fleet.deploy",
    "local_ray_lost": "cluster.fleet.deploy",
    "control_store_answers": "cluster.fleet.deploy",
    "load_tokenizer": "cluster.model_info",
    "local_model": "cluster.model_info",
    "TextStream": "cluster.text",
    "text_after": "cluster.text",
}

__all__ = [
    "LLM",
    "RequestOutput",
    "CompletionOutput",
    "SamplingParams",
    "ReplicaConfig",
    "ServeConfig",
    "AddRequest",
    "ReplicaInfo",
    "ReplicaStats",
    "TokenDelta",
    "FirstTokenHops",
    "ErrorKind",
    "RaylmError",
    "InvalidRequestError",
    "GenerationError",
    "EngineError",
    "ReplicaDownError",
    "RequestTimeoutError",
    "OverloadedError",
    "error_for",
    "Fleet",
    "AutoscalePolicy",
    "AutoscaleSettings",
    "ReplicaLoad",
    "FleetMetrics",
    "ReplicaHandle",
    "ensure_ray",
    "local_ray_lost",
    "control_store_answers",
    "load_tokenizer",
    "local_model",
    "TextStream",
    "text_after",
    "fan_out",
    "GrammarSpec",
    "KVEvents",
    "ReplicaOutput",
    "block_hashes",
    "iter_block_hashes",
    "ChannelAddress",
    "ChannelConnection",
    "RequestLimits",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
