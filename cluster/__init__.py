"""Control plane: requests, scheduling, replicas on Ray, and the offline `LLM` API."""

from cluster.errors import (EngineError, ErrorKind, GenerationError, InvalidRequestError, OverloadedError, RaylmError,
                            ReplicaDownError, RequestTimeoutError, error_for)
from cluster.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "ErrorKind", "RaylmError", "InvalidRequestError",
           "GenerationError", "EngineError", "ReplicaDownError", "RequestTimeoutError", "OverloadedError", "error_for"]


def __getattr__(name: str):
    # the offline API imports torch: loaded on first use, so that cluster.config (which launch.py checks its
    # flags with before anything starts) imports in a fraction of a second
    if name in ("LLM", "RequestOutput"):
        from cluster import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
