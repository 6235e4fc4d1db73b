"""A router's state assembled from its settings: the tokenizer's limits, the model's generation defaults
and parsers, the routing policy, the metrics, and one client per replica."""

from __future__ import annotations

from cluster import ServeConfig
from router.chat.reasoning import reasoning_parser_for
from router.chat.tool_calls import tool_call_parser_for
from router.http.metrics import RouterMetrics
from router.http.state import RequestIds, RouterState, generation_defaults, model_type
from router.replicas.client import client_for
from router.replicas.routing import create_policy


def router_state(
    config: ServeConfig, tokenizer, info, replicas, subscriber: int = 0, first_uid: int = 0, kv_events: bool = True
) -> RouterState:
    """A router's state over the replicas (ReplicaHandles or router.tier.actor.ReplicaRefs): its clients
    poll as `subscriber`, and its request ids start at first_uid (each router and each of its
    incarnations has its own range)."""
    name = config.model_name
    return RouterState(
        config=config,
        tokenizer=tokenizer,
        model_name=name,
        max_seq_len=info.max_seq_len,
        vocab_size=info.vocab_size,
        policy=create_policy(config.routing),
        metrics=RouterMetrics(name),
        defaults=generation_defaults(config.model),
        tool_call_parser=tool_call_parser_for(config.tool_call_parser, model_type(config.model)),
        reasoning_parser=reasoning_parser_for(config.reasoning_parser, model_type(config.model)),
        clients=[client_for(r, config, subscriber, kv_events) for r in replicas],
        uids=RequestIds(first_uid),
        eos_ids=tuple(info.eos_ids),
    )
