"""vLLM's allowed_token_ids and bad_words. Only the tokens of a set may be sampled: greedy output equals
transformers' generate with every other token suppressed (SuppressTokensLogitsProcessor) in float32, under
overlap and speculation alike, and sampled tokens stay in the set. A bad word's last token is masked where
the output ends with the rest of it: greedy output equals generate with NoBadWordsLogitsProcessor over
the same token sequences. Bad values are refused naming their field."""

from __future__ import annotations

import threading

import pytest
from fixtures import PROMPT_TEXTS, hf_generate
from helpers import checked_llm, encode_all
from test_spec_decode import SPEC
from transformers import LogitsProcessorList, NoBadWordsLogitsProcessor, SuppressTokensLogitsProcessor

from cluster import InvalidRequestError, SamplingParams
from cluster.sampling_params import GrammarSpec
from cluster.scheduler.grammars import INLINE_BAD_WORDS, Grammars
from cluster.scheduler.token_set import TokenMaskMatcher, bad_word_sequences


def _allowed(llm, prompts: list[list[int]]) -> list[int]:
    """A set of 40 tokens: some the prompts hold (so that greedy output has likely ones among them), the
    end-of-text token left out."""
    eos = set(llm.scheduler.eos_ids)
    seen = sorted({t for p in prompts for t in p} - eos)
    return seen[::3][:40]


@pytest.mark.parametrize("setting", ["overlap", "no_overlap", "ngram"])
def test_greedy_output_within_the_set_equals_hf_with_the_rest_suppressed(qwen3_path, setting):
    kw = {"overlap": setting != "no_overlap", **(SPEC if setting == "ngram" else {})}
    with checked_llm(qwen3_path, dtype="float32", num_pages=512, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        allowed = _allowed(llm, prompts)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        vocab = llm.engine.hf_config.vocab_size
    suppressed = [t for t in range(vocab) if t not in set(allowed)]
    want = hf_generate(
        qwen3_path,
        prompts,
        12,
        eos_token_id=[],
        logits_processor=lambda n: LogitsProcessorList([SuppressTokensLogitsProcessor(suppressed, device="cpu")]),
    )
    assert got == want
    assert all(set(g) <= set(allowed) for g in got)


def test_sampled_tokens_stay_in_the_set(qwen3_path):
    with checked_llm(qwen3_path, num_pages=512) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:4])
        allowed = _allowed(llm, prompts)[:5]
        params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=3, n=3, allowed_token_ids=allowed)
        outs = [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]
    assert all(len(o) == 16 and set(o) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o}) > 1  # sampled, not one token over and over


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"allowed_token_ids": []}, "must not be empty"),
        ({"allowed_token_ids": [1, 10**6]}, "outside this model's vocabulary"),
        ({"allowed_token_ids": [1, "2"]}, "token ids are integers"),
        ({"allowed_token_ids": [1], "grammar": GrammarSpec("regex", "a+")}, "cannot be combined with a grammar"),
        ({"bad_words": ["ok", " "]}, "must not hold an empty word"),
        ({"bad_words": "ok"}, "must be a list of strings"),
        ({"bad_words": ["ok"], "grammar": GrammarSpec("regex", "a+")}, "cannot be combined with a grammar"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(qwen3_path, kw, says):
    field = next(name for name in ("allowed_token_ids", "bad_words") if name in kw)
    with checked_llm(qwen3_path, num_pages=64) as llm:
        with pytest.raises(InvalidRequestError, match=says) as e:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **kw))
    assert e.value.field == field


@pytest.mark.parametrize("setting", ["overlap", "no_overlap", "ngram"])
def test_greedy_output_without_the_bad_words_equals_hf_with_no_bad_words(qwen3_path, setting):
    kw = {"overlap": setting != "no_overlap", **(SPEC if setting == "ngram" else {})}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with checked_llm(qwen3_path, dtype="float32", num_pages=512, **kw) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:6])
        free = [o.token_ids for o in llm.generate(prompts, greedy)]
        # words the free outputs write: two tokens' (which bite only after the first) and one token's.
        # transformers matches a word's first tokens against the prompt too: no word starts with a
        # prompt's last token
        last = {p[-1] for p in prompts}
        tok = llm.tokenizer

        def writes(ids: list[int]) -> bool:  # the word of `ids` is found as them again
            sequences = bad_word_sequences(tok, [tok.decode(ids)])
            return ids in sequences and all(s[0] not in last for s in sequences if len(s) > 1)

        pairs = [f[i : i + 2] for f in free for i in range(2, 11)]
        words = [tok.decode(ids) for ids in pairs if writes(ids)][:2]
        words += [tok.decode(f[j : j + 1]) for f in free for j in range(12) if writes(f[j : j + 1])][:1]
        sequences = bad_word_sequences(tok, words)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(**{**greedy.__dict__, "bad_words": words}))]
    assert len(words) == 3 and any(len(s) == 2 for s in sequences)
    want = hf_generate(
        qwen3_path,
        prompts,
        12,
        eos_token_id=[],
        logits_processor=lambda n: LogitsProcessorList([NoBadWordsLogitsProcessor(sequences, eos_token_id=[])]),
    )
    assert got == want
    assert got != free  # the words were there to be banned


def test_bad_words_are_the_words_token_ids_alone_and_after_a_space(qwen3_path):
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    word = "capital"
    alone = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    sequences = bad_word_sequences(tokenizer, [word, "  " + word])  # leading spaces are the word's own
    assert sequences[0] == alone and sequences.count(alone) == 2
    assert (spaced in sequences) == (len(spaced) == len(alone) and spaced[0] != alone[0])


def test_the_matcher_masks_a_words_last_token_only_after_the_rest_and_rolls_back():
    import torch

    m = TokenMaskMatcher(64, None, [[5], [7, 8, 9]], output=[1, 7])
    mask = torch.zeros(1, 2, dtype=torch.int32)

    def allowed() -> set[int]:
        m.fill_next_token_bitmask(mask, 0)
        bits = mask.view(torch.uint8).numpy()
        return {t for t in range(64) if bits[0, t // 8] >> (t % 8) & 1}

    assert allowed() == set(range(64)) - {5}
    assert m.accept_token(8) and allowed() == set(range(64)) - {5, 9}
    assert not m.accept_token(9) and not m.accept_token(5)
    m.rollback(1)  # back to [1, 7]
    assert allowed() == set(range(64)) - {5}
    only = TokenMaskMatcher(40, [3, 33], [[33]])
    assert only.accept_token(3) and not only.accept_token(33) and not only.accept_token(4)


def test_a_mask_that_leaves_nothing_to_sample_fails_the_request_naming_its_field(qwen3_path):
    with checked_llm(qwen3_path, num_pages=64) as llm:
        eos = sorted(llm.scheduler.eos_ids)[0]
        tok = llm.tokenizer
        # a token that is a bad word on its own
        piece = next([t] for t in range(3, len(tok)) if [t] in bad_word_sequences(tok, [tok.decode([t])]))
        word = tok.decode(piece)
        for kw, field, says in (
            ({"allowed_token_ids": [eos], "min_tokens": 3}, "min_tokens", r"min_tokens \(3\) holds back"),
            ({"allowed_token_ids": piece, "bad_words": [word]}, "allowed_token_ids", "allows no token"),
        ):
            with pytest.raises(InvalidRequestError, match=says) as e:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **kw))
            assert e.value.field == field


def test_only_a_mask_that_follows_the_output_keeps_its_request_out_of_the_overlap_loop():
    from cluster.scheduler.decode import DecodeManager
    from cluster.scheduler.req import Req

    def waits(**kw) -> bool:
        req = Req(1, [1, 2, 3], SamplingParams(**kw), 64, 0)
        req.matcher = TokenMaskMatcher(64, kw.get("allowed_token_ids"), [[5]] if kw.get("bad_words") else [])
        return DecodeManager._waits(req, speculating=False)

    assert not waits(allowed_token_ids=[4, 5])  # the same mask at every step
    assert waits(bad_words=["x"])  # a word's last token is banned after the rest of it


class _HeldMasks(Grammars):
    """Grammars whose token masks wait for `release` before they are made (as thousands of bad words take
    a while to tokenize), noting the words of every mask a compile thread took up."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        self.release, self.entered, self.ran = threading.Event(), threading.Event(), []

    def _token_masks(self, allowed, words, output):
        self.ran.append(list(words))
        self.entered.set()
        self.release.wait()
        return super()._token_masks(allowed, words, output)


# more words than a mask is made of on the scheduler's thread: these go to the mask thread
MANY = [f"zq{i}" for i in range(INLINE_BAD_WORDS)]


def test_bad_words_are_tokenized_off_the_schedulers_thread(qwen3_path, scripted):
    """A request's bad words are made into its mask on a compile thread: while that is under way every other
    request runs to its end, the masked request waits without a token, and once its mask is made it runs
    with its bad word's token masked. Past grammar_compile_timeout_s a mask not yet made fails its request
    naming bad_words, its pages whole."""
    from cluster.errors import ErrorKind
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    masks = _HeldMasks(tokenizer)

    def script(desc) -> list[int]:  # "a", or "b" where the row's mask forbids "a"
        out = [a] * desc.batch_size
        if desc.grammar_rows is not None:
            for i, row in zip(desc.grammar_rows, desc.grammar_mask):
                if not row[a // 32] >> (a % 32) & 1:
                    out[i] = b
        return out

    s = scripted(script, eos_ids={tokenizer.eos_token_id}, grammar_compile_timeout_s=30)
    s.scheduler.grammars = s.scheduler.builder.grammars = masks
    now = [0.0]
    s.scheduler.clock = lambda: now[0]
    try:
        s.submit(0, [5, 6, 7], max_tokens=3, bad_words=["a", *MANY])
        s.submit(1, [5, 6, 8], max_tokens=3)
        for _ in range(1_000):
            if 1 in s.ended:
                break
            s.scheduler.step()
        assert s.ended == {1: "length"} and s.tokens(1) == [a] * 3 and s.tokens(0) == []
        assert masks.entered.wait(timeout=60) and masks.ran == [["a", *MANY]]  # taken up, waiting on its thread
        masks.release.set()
        for _ in range(100_000):
            if 0 in s.ended:
                break
            s.scheduler.step()
        assert s.ended[0] == "length" and a not in s.tokens(0) and len(s.tokens(0)) == 3

        masks.release.clear()
        s.submit(2, [5, 6, 9], max_tokens=3, bad_words=["b", *MANY])
        s.scheduler.step()
        now[0] = 30.0
        s.scheduler.step()
        (failed,) = [d for d in s.deltas if d.uid == 2]
        assert s.ended[2] == "error" and failed.error_kind == ErrorKind.INVALID_REQUEST
        assert "bad_words were not made into a token mask within 30 s" in failed.error
        assert failed.error_field == "bad_words"
    finally:
        masks.release.set()
    s.run()
    s.check()


def test_bad_words_are_tokenized_without_the_padding_a_tokenizer_was_saved_with(qwen3_path):
    """A tokenizer.json saved after a padded call pads every encoding: each word alone, as `encode` gives it."""
    from cluster.model_info import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_path))
    words = ["capital", "the city of"]
    want = bad_word_sequences(tokenizer, words)
    tokenizer.backend_tokenizer.enable_padding(length=6)
    tokenizer.backend_tokenizer.enable_truncation(2)
    assert bad_word_sequences(tokenizer, words) == want
    assert want[0] == tokenizer.encode("capital", add_special_tokens=False)
