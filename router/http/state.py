"""What the router holds: the model's tokenizer and limits, the replica clients, the routing policy,
and turning an API request into token ids and SamplingParams (with the checks that give 400s)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from cluster import GrammarSpec, InvalidRequestError, RequestLimits, SamplingParams, ServeConfig
from router.chat.tool_calls import written_calls
from router.http.errors import APIError
from router.http.messages import ContentPartError
from router.http.metrics import RouterMetrics
from router.http.protocol import ChatCompletionRequest, SamplingFields
from router.replicas.rebalance import rebalance

log = logging.getLogger(__name__)

# how many (part, chat_template_kwargs, shape) a RouterState remembers seen rendered before it starts again
_TEMPLATE_RENDERS_KEPT = 256


def generation_defaults(model_path: str) -> dict:
    """Sampling values the model's generation_config.json sets (used when a request leaves them out)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the ones vLLM takes from it
    return {k: data[k] for k in keys if data.get(k) is not None}


def model_type(model_path: str) -> str | None:
    """The model folder's config.json model_type ("qwen3", "llama", ...), which picks its parsers."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


# apply_chat_template's own arguments: chat_template_kwargs may not set them
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# the sampler's seeds are 0 .. 2**63 - 1; a request's seed is any 64-bit integer, mapped into them
SEED_RANGE = 2**63


class RequestIds:
    """Request ids from `start` on (a router's own range: no two routers' ids meet on a replica),
    counting how many were issued."""

    def __init__(self, start: int = 0) -> None:
        self.start = self.next_id = start

    def __iter__(self) -> RequestIds:
        return self

    def __next__(self) -> int:
        uid = self.next_id
        self.next_id += 1
        return uid

    @property
    def issued(self) -> int:
        return self.next_id - self.start


@dataclass
class RouterState:
    config: ServeConfig
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    max_seq_len: int
    vocab_size: int
    clients: list = field(default_factory=list)
    policy: object = None
    metrics: RouterMetrics | None = None
    draining: bool = False
    control_store_error: str | None = None  # set while Ray's control store does not answer
    defaults: dict = field(default_factory=dict)
    uids: RequestIds = field(default_factory=RequestIds)
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's creation time
    tool_call_parser: str | None = None  # the served model's tool-call format (router/chat/tool_calls.py)
    reasoning_parser: str | None = None  # its reasoning format (router/chat/reasoning.py)
    response_store: object = None  # the tier's stored responses (router/tier/response_store.py), once used
    eos_ids: tuple[int, ...] = ()  # the replicas' (min_tokens holds them back, in logit_bias's table)
    loop: asyncio.AbstractEventLoop | None = None  # the one the router serves on, once it does
    # the parts of a request (tools, tool_calls, documents) the chat template has been seen to render, by the
    # chat_template_kwargs: a part once rendered is not checked again (a render with and without it each
    # request, on the event loop); one not rendered is checked every time
    template_renders: set[tuple[str, str, str]] = field(default_factory=set)

    async def drain_replica(self, i: int) -> int:
        """Routes nothing more to replica i and empties it of this router's streams: each moves to
        another replica (router/replicas/migration.py) unbroken, or, where it may not move (max_migrations
        0 or used up, no other replica with room), runs to its end there. Returns once none is left on
        it; how many streams it had."""
        return await self.clients[i].drain()

    def drain_replica_from_thread(self, i: int, timeout_s: float | None = None) -> int:
        """drain_replica from another thread than the router's (an operator's call, a test)."""
        return self._from_thread(self.drain_replica(i), timeout_s)

    def undrain_replica(self, i: int) -> int:
        """Routes to replica i again after drain_replica returned (unless it is retiring: the autoscaler's
        scale-down holds it out); requests waiting elsewhere move to it (`rebalance`), as to a replica
        that joined; how many. A drain still emptying it is an error. On the router's event loop."""
        client = self.clients[i]
        if client.draining and client.queues:
            raise ValueError(
                f"replica {i} is still being drained ({len(client.queues)} stream(s) of this router on it): "
                "undrain it once drain_replica returns"
            )
        client.undrain()
        return self.rebalance()

    def undrain_replica_from_thread(self, i: int, timeout_s: float | None = None) -> int:
        """undrain_replica from another thread than the router's."""

        async def undrain() -> int:
            return self.undrain_replica(i)

        return self._from_thread(undrain(), timeout_s)

    def _from_thread(self, coro, timeout_s: float | None) -> int:
        """coro's result, run on the router's event loop from another thread."""
        if self.loop is None:
            coro.close()
            raise RuntimeError("the router is not serving yet")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    # replicas being drained to leave the fleet: their requests finish, no new one goes to them
    retiring: set[int] = field(default_factory=set)

    @property
    def limits(self) -> RequestLimits:
        """What the replicas' model allows a request (the checks a replica makes again on arrival)."""
        return RequestLimits(
            self.max_seq_len,
            self.vocab_size,
            self.config.engine.max_logit_bias,
            frozenset(self.eos_ids),
            self.config.max_prompt_tokens,
        )

    def set_client(self, i: int, client) -> None:
        """Routes replica i's traffic to client from now on (its replacement is serving); requests
        waiting elsewhere move to it (`rebalance`). A replica an operator drained stays drained across
        its replacement: only undrain_replica routes to it again. On the router's event loop."""
        if self.clients[i].draining:
            client.draining = True
        self.clients[i] = client
        self.rebalance()

    def add_client(self, client) -> None:
        """Routes to a replica that joined the fleet (at the end: its id is its index); requests waiting
        elsewhere move to it (`rebalance`). On the router's event loop."""
        self.clients.append(client)
        self.rebalance()

    def resume(self, i: int) -> None:
        """Routes to replica i again, which was retiring (draining for scale-down); requests waiting
        elsewhere move to it (`rebalance`). On the router's event loop."""
        self.retiring.discard(i)
        self.rebalance()

    def rebalance(self) -> int:
        """Hands this router's requests waiting on its busier replicas over to its idler ones, with
        rebalance_on_join (router/replicas/rebalance.py); how many. On the router's event loop."""
        if not self.config.rebalance_on_join:
            return 0
        moved = rebalance(self.routable)
        if moved:
            log.info("%d waiting request(s) handed over to the replicas that joined or came back", moved)
        return moved

    @property
    def routable(self) -> list:
        """The clients new requests may go to: every replica's but those retiring (leaving the fleet) or
        drained (their streams moved elsewhere)."""
        return [c for c in self.clients if c.replica_id not in self.retiring and not c.draining]

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def chat_prompt(self, req: ChatCompletionRequest, tools: list[dict] | None = None, tools_seen: bool = False) -> str:
        """The messages (and tools) rendered by the chat template, with the request's chat_template_kwargs,
        ending with the assistant turn's opening or, continue_final_message, inside the last message.
        Nothing the request holds is left out without a word: documents a template does not render are a
        400, tools too where the model must see them to choose a call (`tools_seen`), and earlier calls it
        does not render are written into their turn's text as the model writes calls."""
        extra = req.chat_template_kwargs or {}
        if reserved := sorted(_TEMPLATE_ARGUMENTS & extra.keys()):
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)} (the request's own fields do)",
                param="chat_template_kwargs",
            )
        documents = req.documents
        unrendered_calls: int | None = None  # the first message whose calls the template leaves out
        messages = []
        called: set[str | None] = set()  # the ids of the calls so far (None: one sent without an id)
        for i, m in enumerate(req.messages):
            try:
                messages.append(m.for_template())
            except ContentPartError as e:
                field = f"messages.{i}.content.{e.index}.{e.field}"
                raise APIError(400, f"{field}: {e}", param=field) from e
            except ValueError as e:
                raise APIError(400, f"messages.{i}: {e}", param=f"messages.{i}") from e
            called.update(c.id for c in m.tool_calls or [])
            if m.role == "tool" and None not in called and m.tool_call_id not in called:
                # as OpenAI's: a result answers a call before it (the template would render it as one)
                field = f"messages.{i}.tool_call_id"
                message = f"{field}: no assistant message before it has a call {m.tool_call_id!r}"
                raise APIError(400, message, param=field)
        try:
            if not _renders_role(self.tokenizer, "developer"):
                # OpenAI's developer messages are system instructions: a template without the role
                # (Qwen's, Llama's) would drop them or render a turn its model never saw
                messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]

            def render(messages: list[dict], tools: list[dict] | None = tools, documents=documents) -> str:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=req.add_generation_prompt is not False,
                    continue_final_message=bool(req.continue_final_message),
                    **({"documents": documents} if documents else {}),
                    **extra,
                )

            # what a template's rendering of a part may hang on besides the part: the kwargs, and for calls
            # whether their turns have text too and more than one call (DeepSeek's renders calls only in a
            # turn without text; Llama 3.1's refuses several)
            with_text = {(bool(m.get("content")), len(m["tool_calls"]) > 1) for m in messages if m.get("tool_calls")}
            shape = str(sorted(with_text))
            kwargs_key = json.dumps(extra, sort_keys=True, default=str)

            def unrendered(part: str, without: Callable[[], str]) -> bool:
                """Whether the template leaves `part` out: the prompt the same without it."""
                key = (part, kwargs_key, shape if part == "tool_calls" else "")
                if key in self.template_renders:
                    return False
                if without() == prompt:
                    return True
                if len(self.template_renders) >= _TEMPLATE_RENDERS_KEPT:  # kwargs are the client's: bounded
                    self.template_renders.clear()
                self.template_renders.add(key)
                return False

            prompt = render(messages)
            with_calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
            if with_calls and unrendered("tool_calls", lambda: render(_without_calls(messages))):
                unrendered_calls = with_calls[0]
                if self.tool_call_parser is not None:
                    messages = _calls_as_text(messages, self.tool_call_parser)
                    prompt = render(messages)
            unrendered_documents = bool(documents) and unrendered("documents", lambda: render(messages, documents=None))
            unrendered_tools = tools_seen and bool(tools) and unrendered("tools", lambda: render(messages, tools=None))
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from e
        except Exception as e:  # noqa: BLE001 - template errors come as many types
            raise APIError(400, f"messages cannot be rendered by the chat template: {e}", param="messages") from e
        if unrendered_documents:
            # a template without documents would leave them out without a word
            raise APIError(400, "documents: this model's chat template does not render documents", param="documents")
        if unrendered_calls is not None and self.tool_call_parser is None:
            field = f"messages.{unrendered_calls}.tool_calls"
            raise APIError(
                400,
                f"{field}: this model's chat template does not render tool calls, and the model has no tool-call "
                "format to write them in (--tool-call-parser)",
                param=field,
            )
        if unrendered_tools:
            raise APIError(
                400,
                "tools: this model's chat template does not render tools, so the model would never see them; "
                'name a function in tool_choice, or "required" (a grammar then makes the output a call), or '
                "serve a model whose chat template renders tools",
                param="tools",
            )
        return prompt

    def sampling_params(
        self,
        req: SamplingFields,
        ids: list[int],
        max_tokens: int | None,
        default_max: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: GrammarSpec | None = None,
        max_tokens_field: str = "max_tokens",
    ) -> SamplingParams:
        """`max_tokens_field`: the request's name for max_tokens (chat's max_completion_tokens), as its
        errors name it."""
        cfg, n, limits = self.config, len(ids), self.limits
        try:
            limits.check_prompt(n)
        except InvalidRequestError as e:
            raise APIError.of(e) from e
        room = self.max_seq_len - n
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"{max_tokens_field} is {max_tokens}, but the prompt ({n} tokens) leaves room for {room} "
                f"within this model's context of {self.max_seq_len} tokens",
                param=max_tokens_field,
                code="context_length_exceeded",
            )
        if max_tokens is not None and cfg.max_tokens_limit and max_tokens > cfg.max_tokens_limit:
            raise APIError(400, f"{max_tokens_field} may be at most {cfg.max_tokens_limit}", param=max_tokens_field)
        if len(req.stop_list) > cfg.max_stop_strings:
            raise APIError(400, f"at most {cfg.max_stop_strings} stop strings are allowed", param="stop")
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"stop token id {bad[0]} is outside the vocabulary", param="stop_token_ids")
        choices = 1 if req.n is None else req.n
        if not 1 <= choices <= cfg.max_n:
            raise APIError(400, f"n must be between 1 and {cfg.max_n}, got {choices}", param="n")
        chosen = max_tokens or default_max or room
        if cfg.max_tokens_limit:
            chosen = min(chosen, cfg.max_tokens_limit)
        pick = lambda name, fallback: (
            getattr(req, name) if getattr(req, name) is not None else self.defaults.get(name, fallback)
        )  # noqa: E731
        try:
            params = SamplingParams(
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", -1),
                min_p=pick("min_p", 0.0),
                max_tokens=min(chosen, room),
                min_tokens=req.min_tokens or 0,
                ignore_eos=req.ignore_eos,
                stop_token_ids=list(req.stop_token_ids or []),
                seed=None if req.seed is None else req.seed % SEED_RANGE,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                logit_bias=self.logit_bias(req),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                n=choices,
                priority=req.priority,
                grammar=grammar,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words or None,
            )
            limits.check_params(params)
        except InvalidRequestError as e:
            raise APIError.of(e) from e
        return params

    def logit_bias(self, req: SamplingFields) -> dict[int, float]:
        """The request's logit_bias keyed by token id (RequestLimits bounds the ids and their number)."""
        biases: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            # at most 19 digits: any id past the vocabulary is refused by its value, and int() of thousands
            # of digits raises (Python bounds integer parsing)
            if not (key.isascii() and key.isdecimal() and len(key) <= 19):
                raise APIError(
                    400,
                    f"logit_bias has the key {key[:32]!r}{'...' if len(key) > 32 else ''}; keys are token ids "
                    f"from 0 to {self.vocab_size - 1}",
                    param="logit_bias",
                )
            biases[int(key)] = value
        return biases


def _without_calls(messages: list[dict]) -> list[dict]:
    return [_no_calls(m) for m in messages]


def _no_calls(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _calls_as_text(messages: list[dict], parser: str) -> list[dict]:
    """Each assistant message's calls written after its text, as the model writes calls (`parser`'s format):
    for a template that renders the text of a turn but not its calls."""
    out = []
    for m in messages:
        if calls := m.get("tool_calls"):
            text = m.get("content") or ""
            m = _no_calls(m)
            m["content"] = text + ("\n" if text else "") + written_calls(parser, calls)
        out.append(m)
    return out


def _renders_role(tokenizer, role: str) -> bool:
    """Whether the tokenizer's chat template (any of its named ones) names the role: one that does not
    renders a message of it as no turn it knows."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(f"'{role}'" in t or f'"{role}"' in t for t in texts)
