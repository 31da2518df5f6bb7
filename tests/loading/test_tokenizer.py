"""Tokenizer tests against the real SmolLM2-135M-Instruct GGUF and golden ids from HF transformers.

The goldens (tests/data/smollm2_tokenizer.json) were produced by HF transformers loading the same
GGUF file. Its GGUF converter pre-tokenizes with the plain GPT-2 regex, while llama.cpp (for
`tokenizer.ggml.pre == "smollm"`) and the original SmolLM2 tokenizer.json first split off every
digit. The two agree except where whitespace or another numeral sits right before a digit; there the
goldens also store `ids_digits_pretokenizer` (same vocabulary, the original pre-tokenizer), which
is what this project's tokenizer must produce. The divergence is pinned down by
`test_golden_hf_gguf_divergence_is_only_the_digit_split`.
"""

import copy
import gzip
import json
import os
import shutil

import pytest

from jaxinfer.loading.gguf import read_metadata
from jaxinfer.loading.tokenizer import IncrementalDetokenizer, Tokenizer

GOLDEN = "smollm2_tokenizer.json"
HF_DIR = "smollm2_tokenizer"


@pytest.fixture(scope="module")
def meta(smollm2_gguf):
    return read_metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def gpt2_pre_tok(meta):
    """The same vocabulary pre-tokenized like HF's GGUF converter does (GPT-2 regex only)."""
    m = dict(meta)
    m["tokenizer.ggml.pre"] = "gpt2"
    return Tokenizer.from_gguf_metadata(m)


@pytest.fixture(scope="module")
def golden(data_dir):
    with open(os.path.join(data_dir, GOLDEN), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def hf_dir_tok(data_dir, tmp_path_factory):
    src = os.path.join(data_dir, HF_DIR)
    dst = tmp_path_factory.mktemp("hf_tokenizer")
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f_in, \
            open(dst / "tokenizer.json", "wb") as f_out:
        shutil.copyfileobj(f_in, f_out)
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                 "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst / name)
    return Tokenizer.from_hf_dir(str(dst))


def _pieces(tok, ids):
    return [tok.id_to_token(i) for i in ids]


# -- model facts ---------------------------------------------------------------------------------

def test_special_tokens_and_flags(tok):
    assert tok.vocab_size == 49152
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert not tok.add_bos
    assert tok.encode("Hello")[0] != tok.bos_token_id
    # llama.cpp also stops on <|endoftext|> for this model.
    assert tok.eos_token_ids == (2, 0)
    assert {0, 1, 2, 16} <= tok.special_ids
    assert tok.encode("a<|im_end|>b") == [tok.encode("a")[0], 2, tok.encode("b")[0]]


def test_digits_are_split_before_the_word_regex(tok):
    # llama.cpp "smollm": isolate each \p{N} first, so the whitespace run before a number stays
    # one piece (merged to a single token) instead of lending its last space to the digits.
    assert _pieces(tok, tok.encode("    42")) == ["ĠĠĠĠ", "4", "2"]
    assert _pieces(tok, tok.encode("x  1")) == ["x", "ĠĠ", "1"]
    assert _pieces(tok, tok.encode("Year 2024")) == ["Year", "Ġ", "2", "0", "2", "4"]


def test_decode_round_trip_and_special_skipping(tok):
    text = "<|im_start|>user\nCafé 日本語 😀 x**2<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nCafé 日本語 😀 x**2\n"


def test_unsupported_tokenizer_model_is_named(meta):
    m = dict(meta)
    m["tokenizer.ggml.model"] = "rwkv"     # 'gpt2' and 'llama' (SentencePiece) are built
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'rwkv'"):
        Tokenizer.from_gguf_metadata(m)
    m = dict(meta)
    m["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(ValueError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata(m)


# The pre-tokenizer regexes as their authors publish them: GPT-2's encoder.py, Meta's llama3
# tokenizer.py (tiktoken pattern), Qwen2's tokenizer (the llama3 one with single digits).
# llama.cpp's "smollm" splits every digit first, then applies GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZER_TEXTS = [
    "It's 12345 apples,\n\n  and 日本 😀!",
    "WE'LL see THEY'RE here; I'M sure it'S fine; O'LLAMA'Sure",
    "x=1234567.89 and 2024-01-02T03:04",
    "  1  22   333\t7\n 8",
    "  leading\t\ttabs   and   runs   \n\n\n   trailing   ",
    "$hello @world #tag ...!!!\r\n\r\nnext",
    "日本語のテキスト、中文，한국어 텍스트",
    "naïve café — ünïcödé «quoted»",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (encoder.py's bytes_to_unicode)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _reference_pieces(pattern: str, digits_first: bool, text: str) -> list[str]:
    """The pre-tokenizer's pieces by definition: the text split with the pattern (the `regex`
    module; with digits_first every digit isolated first), each piece's UTF-8 bytes spelled
    with GPT-2's characters. `regex` is in the test extra (pyproject.toml): the published
    patterns' Unicode property classes need it, and a missing one fails here, not skips."""
    import regex
    chars = _bytes_to_unicode()
    chunks = [c for c in regex.split(r"(\p{N})", text) if c] if digits_first else [text]
    return ["".join(chars[b] for b in w.encode("utf-8"))
            for c in chunks for w in regex.findall(pattern, c)]


def _reference_bpe(vocab: dict, merges: list, pieces: list[str]) -> list[int]:
    """Byte-level BPE from its definition, in plain Python: in each piece, merge the adjacent
    pair of lowest merge rank until none is left; ids from the vocabulary."""
    ranks = {tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m): i
             for i, m in enumerate(merges)}
    ids = []
    for piece in pieces:
        parts = list(piece)
        while len(parts) > 1:
            rank, i = min((ranks.get((parts[i], parts[i + 1]), len(ranks)), i)
                          for i in range(len(parts) - 1))
            if rank == len(ranks):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


@pytest.mark.parametrize("pre, pattern, digits_first", [
    ("gpt2", GPT2_PATTERN, False), ("default", GPT2_PATTERN, False),
    ("smollm", GPT2_PATTERN, True), ("llama-bpe", LLAMA3_PATTERN, False),
    ("qwen2", QWEN2_PATTERN, False)])
def test_pre_tokenizers_against_reference_bpe(meta, data_dir, pre, pattern, digits_first):
    """Each `tokenizer.ggml.pre` over SmolLM2's vocabulary splits text into the pieces of its
    published regex, and encodes to the ids of a plain-Python byte-level BPE (vocabulary and
    merges from SmolLM2's HF tokenizer.json), on texts that tell the regexes apart: digit
    runs, contractions in either case, CJK, whitespace runs, punctuation before newlines."""
    with gzip.open(os.path.join(data_dir, HF_DIR, "tokenizer.json.gz"), "rt",
                   encoding="utf-8") as f:
        model = json.load(f)["model"]
    m = dict(meta)
    m["tokenizer.ggml.pre"] = pre
    t = Tokenizer.from_gguf_metadata(m)
    ours = lambda text: [p for p, _ in t._tok.pre_tokenizer.pre_tokenize_str(text)]  # noqa
    for text in PRE_TOKENIZER_TEXTS:
        pieces = _reference_pieces(pattern, digits_first, text)
        assert ours(text) == pieces, (pre, text)
        want = _reference_bpe(model["vocab"], model["merges"], pieces)
        assert t.encode(text) == want, (pre, text)
        assert t.decode(want) == text
    # The texts tell this pre-tokenizer from every other: a wrong choice would fail above.
    for other in ((GPT2_PATTERN, False), (GPT2_PATTERN, True), (LLAMA3_PATTERN, False),
                  (QWEN2_PATTERN, False)):
        if other != (pattern, digits_first):
            assert any(_reference_pieces(*other, x) != ours(x) for x in PRE_TOKENIZER_TEXTS)


def test_no_chat_template_raises(meta):
    m = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    t = Tokenizer.from_gguf_metadata(m)
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


# -- goldens from HF transformers ----------------------------------------------------------------

def _expected(case):
    # `ids_digits_pretokenizer` is stored where the digit split changes the ids.
    return case.get("ids_digits_pretokenizer", case["ids"])


def test_golden_encode(tok, golden):
    assert golden["cases"]
    wrong = [(c["text"], tok.encode(c["text"]), _expected(c)) for c in golden["cases"]
             if tok.encode(c["text"]) != _expected(c)]
    assert not wrong, wrong


def test_golden_hf_gguf_divergence_is_only_the_digit_split(tok, gpt2_pre_tok, golden):
    """Where HF's GGUF conversion disagrees with llama.cpp, the plain GPT-2 pre-tokenizer over
    the same vocabulary reproduces HF's ids exactly, and each text has whitespace or a numeral
    right before a digit. At the time of writing these are the four texts listed below."""
    divergent = [c for c in golden["cases"] if "ids_digits_pretokenizer" in c]
    assert {c["text"] for c in divergent} == {
        "data = [\n    1,\n    22,\n    333,\n]", "\t7\n 8", "  1  22   333", "١٢٣ ٤٥"}
    for c in golden["cases"]:
        assert gpt2_pre_tok.encode(c["text"]) == c["ids"], c["text"]
    for c in divergent:
        text = c["text"]
        assert tok.encode(text) != c["ids"]
        assert any(text[i].isspace() or text[i].isnumeric()
                   for i in range(len(text) - 1) if text[i + 1].isnumeric()), text


def test_golden_decode_round_trip(tok, golden):
    for case in golden["cases"]:
        for ids in (case["ids"], _expected(case)):
            assert tok.decode(ids, skip_special_tokens=False) == case["text"]


def test_golden_chat(tok, golden):
    assert golden["chat"]
    for case in golden["chat"]:
        rendered = tok.apply_chat_template(
            copy.deepcopy(case["messages"]), add_generation_prompt=case["add_generation_prompt"])
        assert rendered == case["rendered"]
        assert tok.encode(rendered) == case["ids"]


def test_hf_dir_matches_gguf(tok, hf_dir_tok, golden):
    """The tokenizer.json HF saved keeps its converter's GPT-2-only pre-tokenizer, so loading it
    reproduces HF's ids; they equal the GGUF tokenizer's everywhere but the digit cases."""
    assert hf_dir_tok.vocab_size == tok.vocab_size
    assert hf_dir_tok.special_ids == tok.special_ids
    assert (hf_dir_tok.bos_token_id, hf_dir_tok.eos_token_id) == (1, 2)
    assert not hf_dir_tok.add_bos
    assert hf_dir_tok.chat_template == tok.chat_template
    for case in golden["cases"]:
        ids = hf_dir_tok.encode(case["text"])
        assert ids == case["ids"]
        if "ids_digits_pretokenizer" not in case:
            assert ids == tok.encode(case["text"])
    for case in golden["chat"]:
        assert hf_dir_tok.encode(case["rendered"]) == tok.encode(case["rendered"]) == case["ids"]
        assert hf_dir_tok.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"]) == \
            case["rendered"]


# -- streaming detokenization --------------------------------------------------------------------

STREAM_TEXT = "Hi 😀👍🏽 日本語のテキスト, ünïcödé — Ελληνικά 🇫🇷!\n<|im_end|>done"


def _stream(tok, ids, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_one_at_a_time(tok, skip):
    ids = tok.encode(STREAM_TEXT)
    # The text must really put multi-byte characters across several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_incremental_detokenizer_in_chunks(tok):
    ids = tok.encode(STREAM_TEXT)
    detok = IncrementalDetokenizer(tok)
    out = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids)
    assert not any("\ufffd" in d for d in out)


def test_incremental_detokenizer_incomplete_tail(tok):
    # A character cut off at the end of the stream comes out (as U+FFFD) only at flush.
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in ids[:-1])
    assert "\ufffd" not in text
    tail = detok.flush()
    assert text + tail == tok.decode(ids[:-1])
