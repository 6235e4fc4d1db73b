"""Control plane: requests, scheduling, replicas on Ray, and the offline `LLM` API."""

from cluster.llm import LLM, RequestOutput
from cluster.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "InvalidRequestError"]
