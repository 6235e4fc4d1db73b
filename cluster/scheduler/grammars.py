"""Grammars for constrained requests, with xgrammar: compiled off the scheduler's thread (a complex JSON
schema can take a while) and cached by value (xgrammar's compiler cache), then one matcher per request
that advances on the host with each token received and fills the request's next-token bitmask."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from transformers import PreTrainedTokenizerBase

from cluster.errors import InvalidRequestError
from cluster.sampling_params import GrammarSpec, SamplingParams
from cluster.scheduler.json_strings import bounded_strings_text
from cluster.scheduler.token_set import TokenMaskMatcher, bad_word_sequences, plain_backend

# Threads compiling grammars at once: xgrammar releases the GIL while it compiles, and with one thread a
# grammar that takes minutes held every constrained request behind it
GRAMMAR_COMPILE_WORKERS = 4
# a request with at most this many bad words has its mask made on the scheduler's thread (about 1 ms at 64)
INLINE_BAD_WORDS = 64


class Grammars:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr  # loaded with the first replica that serves grammars, not with the package

        self._xgr = xgr
        self.tokenizer = tokenizer  # bad words are tokenized with it (cluster/scheduler/token_set.py)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=GRAMMAR_COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        # token masks have a thread of their own: one never waits behind grammars that compile for minutes
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-masks")
        self._word_backend = plain_backend(tokenizer)

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar; it raises InvalidRequestError for a grammar that does not compile.
        Cancelling it before a thread takes it up saves the compile."""
        return self._pool.submit(self._compile, spec)

    def _compile(self, spec: GrammarSpec):
        c = self.compiler
        try:
            match spec.kind:
                case "json_schema":
                    return c.compile_json_schema(bounded_strings_text(spec.spec), any_whitespace=spec.any_whitespace)
                case "json_object":  # an object, as OpenAI's JSON mode promises (xgrammar's builtin is any value)
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
                case "regex":
                    return c.compile_regex(spec.spec)
                case "ebnf":
                    return c.compile_grammar(spec.spec)
                case "structural_tag":  # its calls' arguments are JSON schemas
                    return c.compile_structural_tag(bounded_strings_text(spec.spec))
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as e:
            raise InvalidRequestError(
                f"the {spec.kind} grammar does not compile: {_first_line(e)}", field="response_format"
            ) from e
        raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", field="response_format")

    def token_masks(self, params: SamplingParams, output: list[int]) -> Future:
        """A future of the matcher of a request's allowed_token_ids and bad words, where its output so far (a
        continued stream's) has taken them; it raises InvalidRequestError for a bad word outside the
        vocabulary. Made at once for a few bad words; more are tokenized on a thread of their own (some 15 us
        a word: a request with thousands would stall every other request's steps on the scheduler's thread)."""
        args = (params.allowed_token_ids, params.bad_words or [], output)
        if len(args[1]) > INLINE_BAD_WORDS:
            return self._mask_pool.submit(self._token_masks, *args)
        made: Future = Future()
        try:
            made.set_result(self._token_masks(*args))
        except InvalidRequestError as e:
            made.set_exception(e)
        return made

    def _token_masks(self, allowed: list[int] | None, words: list[str], output: list[int]) -> TokenMaskMatcher:
        vocab = self.vocab_size
        bad = bad_word_sequences(self.tokenizer, words, self._word_backend)
        if out_of_vocab := [t for w in bad for t in w if t >= vocab]:
            raise InvalidRequestError(
                f"a bad word holds token {out_of_vocab[0]}, outside this model's vocabulary (ids 0 to {vocab - 1})",
                field="bad_words",
            )
        return TokenMaskMatcher(vocab, allowed, bad, output)

    def matcher(self, made) -> object:
        """A request's matcher from what its future gave: a compiled grammar's own, or the token mask's."""
        return made if isinstance(made, TokenMaskMatcher) else self._xgr.GrammarMatcher(made)

    def masks(self, matchers: list) -> np.ndarray:
        """int32 [len(matchers), ceil(vocab_size / 32)]: each matcher's allowed next tokens, one bit a token."""
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask.numpy()

    def verify_masks(self, rows: list[tuple[object, list[int]]]) -> np.ndarray:
        """int32 [sum(len(proposals) + 1), W]: for each (matcher, proposals) of a verify step, the allowed
        tokens at each of its samples: where the matcher is now, then after each proposal in turn (the
        sample after proposal j counts only if the first j are kept). Every proposal must be one its
        grammar accepts (`accepted_prefix` cut them); each matcher is left where it was."""
        bitmask = self._xgr.allocate_token_bitmask(sum(len(p) + 1 for _, p in rows), self.vocab_size)
        i = 0
        for m, proposals in rows:
            for j in range(len(proposals) + 1):
                m.fill_next_token_bitmask(bitmask, i)
                i += 1
                if j < len(proposals) and not m.accept_token(proposals[j]):
                    raise AssertionError(f"proposal {proposals[j]} was not cut where its grammar rejects it")
            if proposals:
                m.rollback(len(proposals))
        return bitmask.numpy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


def accepted_prefix(matcher, tokens: list[int]) -> int:
    """How many leading tokens the matcher's grammar takes from where it is, stopping before one that
    would end the output (after it nothing may be sampled); the matcher is left where it was."""
    n = 0
    for t in tokens:
        if not matcher.accept_token(t):
            break
        n += 1
        if matcher.is_terminated():
            n -= 1
            matcher.rollback(1)
            break
    if n:
        matcher.rollback(n)
    return n


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    # xgrammar prefixes its messages with a time, a source location and the failed check
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0] if lines else type(e).__name__)
    return re.sub(r"^Check failed: .*? is false:\s*", "", text)[:300]
