"""Constrained decoding (xgrammar): output under a grammar always parses and validates unless it ends
at max_tokens; the overlap loop gives what the normal loop gives, and unconstrained requests in the same
batches sample exactly what they sample alone; bad grammars are refused naming the field; compiled
grammars are cached; pages are whole after every run."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
from fixtures import PROMPT_TEXTS
from helpers import checked_llm, encode_all, greedy

from cluster import GrammarSpec, InvalidRequestError, SamplingParams
from cluster.scheduler.grammars import GRAMMAR_COMPILE_WORKERS, Grammars
from worker.batch import BatchDesc, desc_layout, pack_desc, packed_nbytes, unpack_desc

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _constrained(kind: str, spec: str, i: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=400, grammar=GrammarSpec(kind, spec), **kw)


@pytest.mark.parametrize("overlap", [True, False])
def test_json_schema_output_validates_and_plain_rows_are_untouched(qwen3_path, overlap):
    with checked_llm(qwen3_path, overlap=overlap, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True) for i in range(8)]
        mixed = [_constrained("json_schema", json.dumps(SCHEMA), i) if i % 3 == 0 else p for i, p in enumerate(plain)]
        alone = llm.generate(prompts, plain)
        outs = llm.generate(prompts, mixed)
    for i, out in enumerate(outs):
        if i % 3:
            assert out.token_ids == alone[i].token_ids  # beside constrained rows, exactly what they draw alone
        elif out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:  # cut at max_tokens: then it is a prefix of a valid output, which cannot be checked here
            assert out.finish_reason == "length"
    assert sum(o.finish_reason == "stop" for o in outs[::3]) >= 2


def test_overlap_and_normal_loops_give_the_same_constrained_outputs(qwen3_path):
    prompts, params = None, None
    results = []
    for overlap in (True, False):
        with checked_llm(qwen3_path, overlap=overlap) as llm:
            prompts = encode_all(llm, PROMPT_TEXTS[:6])
            params = [_constrained("regex", r"(yes|no), because [a-z ]{3,12}\.", i) for i in range(3)] + [
                _constrained("json_object", "", i) for i in range(3)
            ]
            results.append([o.token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]


def test_regex_and_ebnf_outputs_match_their_grammar(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:4])
        regex = r"<think>[a-z]{2,5}</think>(hello|goodbye) [0-9]{1,3}"
        ebnf = 'root ::= "call(" arg ("," arg)* ")"\narg ::= [a-c]+'
        outs = llm.generate(
            prompts,
            [
                _constrained("regex", regex, 0),
                _constrained("regex", regex, 1),
                _constrained("ebnf", ebnf, 2),
                greedy(200, grammar=GrammarSpec("ebnf", ebnf)),
            ],
        )
    for out in outs[:2]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text)
    for out in outs[2:]:
        assert out.finish_reason == "stop" and re.fullmatch(r"call\([a-c]+(,[a-c]+)*\)", out.text)


def test_max_tokens_cuts_a_constrained_output_with_length(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        out = llm.generate(
            encode_all(llm, PROMPT_TEXTS[:1]),
            SamplingParams(temperature=0, max_tokens=5, grammar=GrammarSpec("regex", "[a-z]{50}")),
        )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_constrained_requests_survive_preemption(qwen3_path):
    with checked_llm(qwen3_path, page_size=4, num_pages=40, decode_reserve_tokens=1) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8])
        regex = r"[a-z]{30,40}"
        outs = llm.generate(
            prompts,
            [
                SamplingParams(temperature=0.9, seed=i, max_tokens=60, grammar=GrammarSpec("regex", regex))
                for i in range(8)
            ],
        )
        assert llm.stats().preempted > 0
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text)


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("json_schema", "{not json"),
        ("json_schema", '{"type": "nonsense"}'),
        ("regex", "(unclosed"),
        ("ebnf", "root ::= missing_rule"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(qwen3_path, kind, spec):
    with checked_llm(qwen3_path) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:2])
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts[:1], SamplingParams(grammar=GrammarSpec(kind, spec)))
        assert "does not compile" in str(e.value) and e.value.field == "response_format"
        assert llm.generate(prompts[1:], greedy(4))[0].finish_reason  # the scheduler serves on


def test_compiled_grammars_are_cached_by_value(qwen3_path):
    with checked_llm(qwen3_path) as llm:
        compiler = llm.scheduler.grammars.compiler
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        llm.scheduler.grammars.compile(spec).result()
        size = compiler.get_cache_size_bytes()
        assert size > 0
        llm.scheduler.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).result()
        assert compiler.get_cache_size_bytes() == size


def test_grammar_rows_travel_in_the_packed_step():
    ones = np.ones(3, dtype=np.float32)
    desc = BatchDesc(
        False,
        slots=np.array([0, 2, 5], np.int32),
        seq_lens=np.array([4, 9, 7], np.int32),
        extend_lens=np.ones(3, np.int32),
        out_loc=np.array([3, 8, 6], np.int32),
        input_ids=None,
        temperature=ones,
        top_p=ones,
        top_k=np.zeros(3, np.int32),
        seeds=np.arange(3, dtype=np.int64),
        grammar_rows=np.array([0, 2], np.int32),
        grammar_mask=np.arange(24, dtype=np.int32).reshape(2, 12) - 5,
    )
    layout = desc_layout(desc)
    buf = np.zeros(packed_nbytes(layout), dtype=np.uint8)
    pack_desc(desc, layout, buf)
    got = unpack_desc(layout, buf)
    assert got.grammar_rows.tolist() == [0, 2]
    assert np.array_equal(got.grammar_mask, desc.grammar_mask)


def test_a_token_the_grammar_rejects_fails_the_request_and_never_reaches_it(qwen3_path, scripted):
    """Should a step ever sample a token its row's mask forbids, the request ends with an engine error
    naming its grammar (a 500 over HTTP), not with `stop` and broken text; the rest of the batch goes on."""
    from cluster.errors import ErrorKind
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    vocab = len(tokenizer)
    digit, letter = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("a")

    def tokens(desc):
        # row 0's grammar allows letters only: its first token is one, its second a digit
        return [letter if len(s.tokens(0)) == 0 else digit] + [letter] * (desc.batch_size - 1)

    s = scripted(tokens, eos_ids={tokenizer.eos_token_id})
    s.scheduler.grammars = s.scheduler.builder.grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    s.submit(0, [5, 6, 7], max_tokens=8, grammar=GrammarSpec("regex", "[a-z]{6}"))
    s.submit(1, [5, 6, 8], max_tokens=4)
    s.run()
    assert s.tokens(0) == [letter] and digit not in s.tokens(0)
    last = [d for d in s.deltas if d.uid == 0][-1]
    assert last.finish_reason == "error" and last.error_kind == ErrorKind.ENGINE and "regex grammar" in last.error
    assert s.ended == {0: "error", 1: "length"} and len(s.tokens(1)) == 4
    s.check()


BOUNDED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "maxLength": 5},
        "note": {"type": "string", "minLength": 2, "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["code", "note", "tags"],
    "additionalProperties": False,
}


def test_strings_bounded_by_max_length_parse_and_validate(qwen3_path):
    """Random weights pick control characters freely where a grammar admits them: every output that
    ends under a schema of maxLength strings parses (no raw control character) and validates, and is
    compact JSON."""
    with checked_llm(qwen3_path, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:8]) * 4
        params = [_constrained("json_schema", json.dumps(BOUNDED), i) for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert len(ended) >= len(outs) // 2
    for out in ended:
        value = json.loads(out.text)
        jsonschema.validate(value, BOUNDED)
        assert out.text == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_only_ends_where_min_tokens_forbids_it_is_the_callers_error(qwen3_path, temperature):
    """Three digits, then only EOS, which min_tokens 8 holds back: no output satisfies both. The request
    fails as the caller's error naming min_tokens (never a stop short of min_tokens, nor a server
    fault), and the engine serves on."""
    from cluster.errors import ErrorKind, RaylmError

    params = SamplingParams(temperature=temperature, seed=3, max_tokens=16, min_tokens=8)
    with checked_llm(qwen3_path, page_size=4) as llm:
        with pytest.raises(RaylmError) as failed:
            llm.generate([[5, 6, 7]], replace(params, grammar=GrammarSpec("regex", "[0-9]{3}")))
        assert failed.value.kind == ErrorKind.INVALID_REQUEST and "min_tokens (8)" in str(failed.value)
        (free,) = llm.generate([[5, 6, 7]], params)
    assert len(free.token_ids) >= 8


class _HeldGrammars(Grammars):
    """Grammars whose compiles of the `held` specs wait for `release` (a grammar xgrammar takes minutes
    over), noting every spec a compile thread took up."""

    def __init__(self, tokenizer, held: set[str]) -> None:
        super().__init__(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        self.held, self.release, self.ran = held, threading.Event(), []

    def _compile(self, spec: GrammarSpec):
        self.ran.append(spec.spec)
        if spec.spec in self.held:
            self.release.wait()
        return super()._compile(spec)


class _Recorded:
    """A scheduler's inbox that notes whether each read waits for a message."""

    def __init__(self, inner) -> None:
        self.inner, self.blocks = inner, []

    def get(self, block: bool = True, timeout: float | None = None):
        self.blocks.append(block)
        return self.inner.get(block, timeout)

    def put(self, item) -> None:
        self.inner.put(item)

    def empty(self) -> bool:
        return self.inner.empty()


def _with_grammars(s, grammars):
    s.scheduler.grammars = s.scheduler.builder.grammars = grammars
    return s


def _step_until(s, uids: set[int], max_steps: int = 1_000_000) -> None:
    """Steps until every request of `uids` has ended (their grammars compile on other threads)."""
    for _ in range(max_steps):
        if uids <= s.ended.keys():
            return
        s.scheduler.step()
    raise AssertionError(f"requests {uids - s.ended.keys()} never ended")


def test_a_grammar_slow_to_compile_holds_back_no_other_request_and_fails_at_its_deadline(qwen3_path, scripted):
    """While one request's grammar compiles (for minutes, as a schema of thousands of properties can),
    other constrained requests compile beside it and plain ones run; past grammar_compile_timeout_s the slow
    one fails as the caller's error naming response_format, and its pages and slot are whole."""
    from cluster.errors import ErrorKind
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    letter = tokenizer.convert_tokens_to_ids("a")
    grammars = _HeldGrammars(tokenizer, held={"[a-z]{4}"})
    s = _with_grammars(
        scripted(
            lambda desc: [letter] * desc.batch_size, eos_ids={tokenizer.eos_token_id}, grammar_compile_timeout_s=30
        ),
        grammars,
    )
    now = [0.0]
    s.scheduler.clock = lambda: now[0]
    try:
        s.submit(0, [5, 6, 7], max_tokens=4, grammar=GrammarSpec("regex", "[a-z]{4}"))
        s.submit(1, [5, 6, 8], max_tokens=2, grammar=GrammarSpec("regex", "a{2}"))
        s.submit(2, [5, 6, 9], max_tokens=4)
        _step_until(s, {1, 2})
        assert s.ended == {1: "length", 2: "length"} and s.tokens(1) == [letter] * 2
        # with every live request waiting for its grammar, a serving loop's step waits on its inbox
        inbox = s.scheduler.inbox = _Recorded(s.scheduler.inbox)
        s.scheduler.step(block=True)
        assert inbox.blocks[0] is True
        now[0] = 29.9
        s.scheduler.step()
        assert 0 not in s.ended
        now[0] = 30.0
        s.scheduler.step()
        (failed,) = [d for d in s.deltas if d.uid == 0]
        assert s.ended[0] == "error" and failed.error_kind == ErrorKind.INVALID_REQUEST
        assert "regex grammar did not compile within 30 s" in failed.error
        assert failed.error_field == "response_format"  # what a client's 400 names
    finally:
        grammars.release.set()
    s.run()
    s.check()


def test_a_request_aborted_before_its_grammar_compiles_never_compiles_it(qwen3_path, scripted):
    """With every compile thread busy, a constrained request that is aborted while its compile waits for
    a thread leaves nothing to compile: the thread that comes free never takes its grammar up."""
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    letter = tokenizer.convert_tokens_to_ids("a")
    busy = {f"[a-z]{{{i + 1}}}": i for i in range(GRAMMAR_COMPILE_WORKERS)}
    grammars = _HeldGrammars(tokenizer, held=set(busy))
    s = _with_grammars(scripted(lambda desc: [letter] * desc.batch_size, eos_ids={tokenizer.eos_token_id}), grammars)
    try:
        for spec, uid in busy.items():  # one compile for each thread, each waiting
            s.submit(uid, [5, 6, 7 + uid], max_tokens=uid + 1, grammar=GrammarSpec("regex", spec))
        late = len(busy)
        s.submit(late, [5, 6, 3], max_tokens=2, grammar=GrammarSpec("regex", "b{2}"))
        s.scheduler.step()
        s.scheduler.abort(late)
        s.scheduler.step()
        assert s.ended == {late: "abort"}
    finally:
        grammars.release.set()
    _step_until(s, set(busy.values()))
    assert all(s.ended[uid] == "length" for uid in busy.values())
    assert "b{2}" not in grammars.ran and sorted(grammars.ran) == sorted(busy)
    s.check()
