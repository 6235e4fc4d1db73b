"""An output's text reads as it does after its prompt: a SentencePiece-style tokenizer (Llama 2's, Mistral's)
keeps the space its first word carries ("... France is" + " Paris", not "Paris"), and a character whose
bytes the prompt begins is the output's, whole; the same through the router's streams, the offline engine
and the HTTP API's echo."""

from __future__ import annotations

import random
import re

import pytest
from fixtures import PROMPT_TEXTS
from helpers import client, serving
from tiny_checkpoints import build_metaspace_tokenizer, with_metaspace_tokenizer

from cluster import LLM, GrammarSpec, SamplingParams
from cluster.model_info import load_tokenizer
from cluster.text import prompt_tail, text_after
from router.chat.detokenizer import IncrementalDetokenizer

TEXTS = [PROMPT_TEXTS[1] + " is Paris.", PROMPT_TEXTS[2], PROMPT_TEXTS[4], PROMPT_TEXTS[5]]


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory):
    return build_metaspace_tokenizer(tmp_path_factory.mktemp("metaspace"))


@pytest.fixture(scope="module")
def metaspace_path(tmp_path_factory, qwen3_path):
    return with_metaspace_tokenizer(qwen3_path, tmp_path_factory.mktemp("metaspace_model") / "model")


def streamed(tokenizer, prompt: list[int], ids: list[int]) -> str:
    d = IncrementalDetokenizer(tokenizer, [], prompt_ids=prompt)
    return "".join(d.add(t) for t in ids) + d.flush()


def after(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What the whole text holds past the prompt's own: the text of its longest head of whole characters (a
    character the prompt ends inside is the output's; the texts hold no U+FFFD of their own)."""
    decode = tokenizer.backend_tokenizer.decode
    whole, j = decode(prompt + ids), len(prompt)
    while "\ufffd" in decode(prompt[:j]):
        j -= 1
    assert whole.startswith(decode(prompt[:j]))
    return whole[len(decode(prompt[:j])) :]


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_an_outputs_text_is_the_whole_texts_past_its_prompt_at_every_split(kind, metaspace, qwen3_path):
    tokenizer = metaspace if kind == "metaspace" else load_tokenizer(str(qwen3_path))
    splits_inside_a_character = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for k in range(1, len(ids)):
            want = after(tokenizer, ids[:k], ids[k:])
            splits_inside_a_character += tokenizer.decode(ids[:k]).endswith("\ufffd")
            assert streamed(tokenizer, ids[:k], ids[k:]) == want, (text, k)
            assert text_after(tokenizer, ids[:k], ids[k:]) == want, (text, k)
    assert splits_inside_a_character > 0  # the texts' characters of several bytes are split somewhere


def test_the_first_word_keeps_its_space_behind_a_sentencepiece_prompt(metaspace):
    ids = metaspace(TEXTS[0], add_special_tokens=False).input_ids
    k = next(k for k in range(len(ids), 0, -1) if metaspace.decode(ids[:k]) == PROMPT_TEXTS[1] + " is")
    assert metaspace.convert_ids_to_tokens(ids[k]).startswith("\u2581")
    assert metaspace.decode(ids[k:]) == "Paris."  # decoded alone, the space is gone
    assert streamed(metaspace, ids[:k], ids[k:]) == " Paris." == text_after(metaspace, ids[:k], ids[k:])


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_a_prompt_ending_in_the_replacement_character_itself_lends_the_output_none_of_its_text(
    kind, metaspace, qwen3_path
):
    tokenizer = metaspace if kind == "metaspace" else load_tokenizer(str(qwen3_path))
    out = tokenizer(" world", add_special_tokens=False).input_ids
    for prompt_text in ("Hello \ufffd", "Hello \ufffd\ufffd", "Hello\ufffd"):
        prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
        assert tokenizer.decode(prompt) == prompt_text
        text = streamed(tokenizer, prompt, out)
        assert text == text_after(tokenizer, prompt, out) == tokenizer.backend_tokenizer.decode(out)
        assert "\ufffd" not in text


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_a_character_the_prompt_leaves_unfinished_stays_the_prompts_when_the_output_does_not_finish_it(
    kind, metaspace, qwen3_path
):
    """A prompt that ends inside a character (random or cut token lists do) lends its stray bytes to an
    output only to complete that character: an output that begins a character of its own (a grammar's
    letters) reads as its own tokens do, with no U+FFFD from the prompt's bytes."""
    tokenizer = metaspace if kind == "metaspace" else load_tokenizer(str(qwen3_path))
    ids = tokenizer("Hello \u65e5\u672c \U0001f642", add_special_tokens=False).input_ids
    inside = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert inside  # the characters of several bytes are split across tokens somewhere
    for k in inside:
        for text in (" world", "toe no", "world"):
            out = tokenizer(text, add_special_tokens=False).input_ids
            whole = next(j for j in range(k, -1, -1) if "\ufffd" not in tokenizer.decode(ids[:j]))
            own = after(tokenizer, ids[:whole], out)  # as the output reads after the prompt's whole characters
            assert "\ufffd" not in own
            assert streamed(tokenizer, ids[:k], out) == own == text_after(tokenizer, ids[:k], out), (k, text)
        # one that does complete it still takes the character, whole
        assert streamed(tokenizer, ids[:k], ids[k:]) == after(tokenizer, ids[:k], ids[k:])


def test_a_grammars_letters_after_a_prompt_cut_inside_a_character_read_as_letters(qwen3_path):
    """The engine's text of a constrained output after a prompt that ends inside a character (a random
    token list's end, as benchmarks and tests send) matches its grammar: no U+FFFD from the prompt."""
    llm = LLM(str(qwen3_path), num_pages=256, page_size=4)
    tokenizer = llm.tokenizer
    ids = tokenizer("Hello \u65e5\u672c \U0001f642", add_special_tokens=False).input_ids
    prompts = [ids[:k] for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    regex = r"[a-z]{4,8} (yes|no)"
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, grammar=GrammarSpec("regex", regex))
    for out in llm.generate(prompts, params):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(regex, out.outputs[0].text), out.outputs[0]


def test_the_offline_engines_text_follows_its_prompt(metaspace_path):
    llm = LLM(str(metaspace_path), num_pages=256, page_size=4)
    tokenizer = llm.tokenizer
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == after(tokenizer, prompt, ids)
    # every output made of a word's first piece, which carries its space
    piece = tokenizer.convert_tokens_to_ids("\u2581c")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={piece: 100.0})
    assert [o.outputs[0].text for o in llm.generate(prompts, params)] == [" c c c"] * len(prompts)


def test_echo_and_streams_over_http_keep_the_first_words_space(ray_cluster, metaspace_path):
    tokenizer = load_tokenizer(str(metaspace_path))
    piece = tokenizer.convert_tokens_to_ids("\u2581c")  # a word's first piece, which carries its space
    with serving(metaspace_path, num_pages=256) as srv:
        c = client(srv)
        for text in TEXTS:
            args = dict(model="tiny", prompt=text, max_tokens=3, temperature=0, logit_bias={str(piece): 100})
            plain = c.completions.create(**args).choices[0]
            whole = c.completions.create(**args, echo=True).choices[0]
            chunks = c.completions.create(**args, stream=True)
            assert plain.text == " c c c"
            assert whole.text == text + " c c c"
            assert "".join(ch.choices[0].text for ch in chunks) == " c c c"
            # the logprob tokens are the text's pieces, each word's space with it, and index it
            scored = c.completions.create(**args, logprobs=1).choices[0].logprobs
            assert (scored.tokens, scored.text_offset) == ([" c"] * 3, [0, 2, 4])


def test_stray_bytes_never_break_the_stream(metaspace):
    """Random tokens, stray bytes of byte-fallback runs among them (which make tokenizers' DecodeStream raise
    as a later byte changes an earlier one's text), stream without an error; the text of those that make
    whole characters is the whole text past the prompt."""
    rng = random.Random(0)
    names = metaspace.convert_ids_to_tokens(list(range(3, len(metaspace))))
    stray_bytes = [i for i, n in enumerate(names, 3) if n.startswith("<0x")]
    pieces = [i for i, n in enumerate(names, 3) if not n.startswith("<0x")]
    stray = whole_characters = 0
    for _ in range(300):
        ids = [rng.choice(stray_bytes if rng.random() < 0.1 else pieces) for _ in range(16)]
        prompt, out = ids[:4], ids[4:]
        d = IncrementalDetokenizer(metaspace, [], prompt_ids=prompt)
        text = "".join(d.add(t) for t in out) + d.flush()
        want = text_after(metaspace, prompt, out)
        if "\ufffd" in want:
            stray += 1
        else:
            whole_characters += 1
            assert text == want
    assert stray > 50 and whole_characters > 50


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_random_prompts_lend_the_output_none_of_their_stray_bytes(kind, metaspace, qwen3_path):
    """Random token lists (as benchmarks send, and as a model with random weights answers): stray bytes at
    a prompt's end, whole or not, never show in its output's text, which streams as it decodes at once;
    over a byte-level tokenizer an output of whole characters reads exactly as its own tokens do."""
    tokenizer = metaspace if kind == "metaspace" else load_tokenizer(str(qwen3_path))
    rng = random.Random(5)
    checked = 0
    for _ in range(1000):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        out = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 10))]
        own = tokenizer.backend_tokenizer.decode(out)
        whole = text_after(tokenizer, prompt, out)
        if "\ufffd" in own:
            continue
        checked += 1
        assert "\ufffd" not in whole, (prompt, out)
        assert streamed(tokenizer, prompt, out) == whole, (prompt, out)
        if kind == "byte_level":
            assert whole == own, (prompt, out)
    assert checked > 100


def test_an_output_of_byte_tokens_after_a_prompts_stray_bytes_streams_as_it_goes(metaspace):
    """A byte-fallback output (characters of no piece of their own) after a prompt that ends inside a
    character: the prompt's bytes and the output's run together as one invalid run, which decodes as
    U+FFFD throughout, but each of the output's characters is released as it completes, and a stop string
    in them is found, not left for the flush."""
    prompt = metaspace("Hello world", add_special_tokens=False).input_ids + metaspace.convert_tokens_to_ids(
        ["<0xF0>", "<0x9F>"]
    )
    # characters the tokenizer never saw, so never pieces of their own (its 40-character alphabet is chosen
    # among ties differently from one training to the next)
    out = metaspace("\u732b\u72ac\u9ce5", add_special_tokens=False).input_ids
    names = metaspace.convert_ids_to_tokens(out)
    out = [t for t, n in zip(out, names) if n.startswith("<0x")]  # the characters' bytes, without the word's mark
    assert len(out) == 9
    assert text_after(metaspace, prompt, out) == "\u732b\u72ac\u9ce5"
    d = IncrementalDetokenizer(metaspace, [], prompt_ids=prompt)
    assert [d.add(t) for t in out] == ["", "", "\u732b", "", "", "\u72ac", "", "", "\u9ce5"]
    stopping = IncrementalDetokenizer(metaspace, ["\u72ac"], prompt_ids=prompt)
    released = "".join(stopping.add(t) for t in out[:6])
    assert stopping.stopped and released == "\u732b"


def holds(stream: str, whole: str) -> bool:
    """Whether a stream's text holds the whole decode's text between its U+FFFD runs, in order, and nothing
    else outside them. Where the whole decode shows U+FFFD the stream may show other U+FFFD, or characters it
    released before a later stray byte joined their run of byte tokens (the whole decode then shows the run's
    every byte as U+FFFD; what was released stays released)."""
    parts = re.split("(\ufffd+)", whole)
    pattern = "".join(".*?" if p.startswith("\ufffd") else re.escape(p) for p in parts if p)
    return re.fullmatch(pattern, stream, re.S) is not None


def test_a_stray_byte_after_released_characters_loses_none_of_the_text_after_it(metaspace):
    """A stray byte makes a byte-fallback run's earlier characters U+FFFD in a whole decode. The stream keeps
    what it released and goes on: the characters after the stray byte are all released (a window of the
    last tokens that began inside a run of byte tokens showed them as U+FFFD, and stopped the stream), and a
    prompt's own characters never show in the output as U+FFFD."""
    byte = lambda *hexes: metaspace.convert_tokens_to_ids([f"<0x{h}>" for h in hexes])  # noqa: E731
    words = lambda text: metaspace(text, add_special_tokens=False).input_ids  # noqa: E731
    cjk = byte("E8", "AA", "9E", "E7", "95", "8C", "E4", "B8", "96")  # 語界世, a byte token each byte
    prompt = words("Hi") + byte("F0", "9F", "99", "82")  # a whole emoji of byte tokens
    out = byte("F0") + words(" x") + cjk
    assert streamed(metaspace, prompt, out) == text_after(metaspace, prompt, out) == "\ufffd x\u8a9e\u754c\u4e16"
    out = byte("E6", "9C", "AC", "F0") + words(" x") + cjk + words(" ok")  # 本, then a stray byte
    assert text_after(metaspace, [], out) == "\ufffd" * 4 + " x\u8a9e\u754c\u4e16 ok"
    assert streamed(metaspace, [], out) == "\u672c" + "\ufffd" * 3 + " x\u8a9e\u754c\u4e16 ok"
    out = byte("E6", "9C", "AC", "F0") + words(" x") + byte("E8", "AA", "9E", "F0")  # it ends in a stray byte too
    assert text_after(metaspace, [], out) == "\ufffd" * 4 + " x" + "\ufffd" * 4
    # the flush shows the last bytes as U+FFFD, as the whole decode does, though that no longer begins as
    # the released text
    assert streamed(metaspace, [], out) == "\u672c" + "\ufffd" * 3 + " x\u8a9e" + "\ufffd" * 3
    # the prompt ends in a whole emoji and a character's first byte, and the output's ten stray bytes do not
    # finish it: past a few tokens the stream stops waiting for them to, and shows only the output's bytes
    prompt = words("Hi") + byte("F0", "9F", "99", "82", "F0")
    out = byte(*["80"] * 10) + words(" x")
    assert streamed(metaspace, prompt, out) == text_after(metaspace, prompt, out) == "\ufffd" * 10 + " x"


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each token's bytes: a byte-fallback token's byte, a SentencePiece piece's text with its spaces, a
    byte-level token's bytes through GPT-2's map; special tokens none."""
    names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    if any(n.startswith("<0x") for n in names):
        of = {
            i: bytes.fromhex(n[3:5]) if n.startswith("<0x") else n.replace("\u2581", " ").encode()
            for i, n in enumerate(names)
        }
    else:
        # GPT-2's map of bytes to printable characters: the printable Latin-1 bytes stand for themselves, the
        # rest for the characters from U+0100 on, in byte order
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        others = [b for b in range(256) if b not in printable]
        byte_of = {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(others)}
        of = {i: bytes(byte_of[c] for c in n) if all(c in byte_of for c in n) else b"" for i, n in enumerate(names)}
    return {i: b"" if i in special else b for i, b in of.items()}


def lenient(bytes_of: dict[int, bytes], ids: list[int]) -> str:
    """The tokens' bytes decoded together, each invalid byte U+FFFD (Python's errors="replace")."""
    return b"".join(bytes_of[i] for i in ids).decode("utf-8", errors="replace")


def within(stream: str, reference: str) -> bool:
    """Whether the stream's characters other than U+FFFD are a subsequence of the reference's."""
    rest = iter(reference)
    return all(c in rest for c in stream if c != "\ufffd")


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_pieces_of_texts_with_stray_bytes_stream_all_their_text(kind, metaspace, qwen3_path):
    """Pieces of real texts cut anywhere, stray bytes between them, split into prompt and output anywhere:
    the stream holds the whole decode's text (`holds`), and equals it where that has no U+FFFD; it shows
    nothing but the output's own: its characters are among those of the output's bytes with the prompt's
    last unfinished character (in order, none twice), and its U+FFFD no more than those bytes."""
    tokenizer = metaspace if kind == "metaspace" else load_tokenizer(str(qwen3_path))
    bytes_of = token_bytes(tokenizer)
    names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    stray_bytes = [i for i, n in enumerate(names) if n.startswith("<0x")] or [
        tokenizer.convert_tokens_to_ids(c)
        for c in "\u00c3\u00a4\u00e6\u00f0"  # byte-level: lone lead bytes
    ]
    texts = [*TEXTS, "\u4f60\u597d\uff0c\u4e16\u754c\uff01\U0001f600 ok", "a\u00e9\u00e9 \u65e5\u65e5 x \U0001f642"]
    rng = random.Random(1)
    with_stray = 0
    for _ in range(800):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 4)):
            piece = tokenizer(rng.choice(texts), add_special_tokens=False).input_ids
            a = rng.randrange(len(piece))
            ids += piece[a : rng.randrange(a + 1, len(piece) + 1)]
            if rng.random() < 0.5:
                ids.append(rng.choice(stray_bytes))
        cut = rng.randrange(len(ids))
        prompt, out = ids[:cut], ids[cut:]
        whole, text = text_after(tokenizer, prompt, out), streamed(tokenizer, prompt, out)
        with_stray += "\ufffd" in whole
        assert holds(text, whole) and ("\ufffd" in whole or text == whole), (prompt, out, text, whole)
        own = [*prompt_tail(tokenizer, prompt)[1], *out]  # with the prompt's unfinished character's tokens
        assert within(text, lenient(bytes_of, own)), (prompt, out, text)
        assert text.count("\ufffd") <= sum(len(bytes_of[i]) for i in own), (prompt, out, text)
    assert with_stray > 50
