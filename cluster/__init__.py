"""Control plane: requests, scheduling, replicas on Ray, and the offline `LLM` API."""

from cluster.errors import (EngineError, ErrorKind, GenerationError, InvalidRequestError, OverloadedError, RaylmError,
                            ReplicaDownError, RequestTimeoutError, error_for)
from cluster.llm import LLM, RequestOutput
from cluster.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "ErrorKind", "RaylmError", "InvalidRequestError",
           "GenerationError", "EngineError", "ReplicaDownError", "RequestTimeoutError", "OverloadedError", "error_for"]
