"""Byte-level BPE tokenizers (SmolLM2's GGUF and its vocabulary under other pre-tokenizer names):
ids equal to transformers' (and to llama.cpp's where known), lossless round trips, streaming decode."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from realizar.errors import TokenizerError
from realizar.text.gguf_vocab import PRE_TOKENIZER_SPLITS
from realizar.text.tokenizer import Tokenizer
from tests.tokenizer_cases import (  # noqa: F401 - fixtures
    BYTE_TO_CHAR,
    MIXED,
    CORPUS,
    STREAM_TEXTS,
    gguf_metadata,
    hf_gguf_tokenizer,
    hf_ids,
    spellable,
    stream_deltas,
    smol,
    smol_hf,
    smol_md,
    smol_path,
)
from tests.helpers import examples


# ----------------------------------------------------------------------------------------------
# byte-level BPE: SmolLM2
# ----------------------------------------------------------------------------------------------


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
    assert ids == hf_ids(smol_hf, text)
    assert smol.decode(ids) == text
    assert smol.decode(ids) == smol_hf.decode(ids)
    assert smol.decode(ids, skip_special_tokens=True) == smol_hf.decode(ids, skip_special_tokens=True)


@pytest.mark.oracle
def test_transformers_gguf_loader_differs_only_on_digits(smol, smol_path):
    raw = hf_gguf_tokenizer(smol_path)  # as transformers builds it from the GGUF, unpatched
    for text in CORPUS:
        if not any(unicodedata.category(c).startswith("N") and not c.isascii() for c in text):
            assert smol.encode(text) == hf_ids(raw, text), text
    # SmolLM2's vocabulary has merges across non-ASCII digits, which its tokenizer.json never uses
    text = "x ٣٤٥ ²³"
    assert smol.encode(text) != hf_ids(raw, text)
    assert [smol.decode([i]) for i in smol.encode(text)][-2:] == ["²", "³"]


def test_smol_known_ids(smol):
    # ids from the task notes (llama.cpp on SmolLM2)
    assert smol.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]


@pytest.mark.oracle
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_smol_drawn_text_matches_transformers(smol, smol_hf, text):
    ids = smol.encode(text)
    assert ids == hf_ids(smol_hf, text)
    if spellable(smol, text):
        assert smol.decode(ids) == text
    else:
        assert smol.decode(ids) == smol_hf.decode(ids)


@pytest.mark.oracle
def test_smol_unspellable_bytes_are_dropped(smol, smol_hf):
    # U+40000 is F1 80 80 80; SmolLM2 has no token for the byte F1
    assert not spellable(smol, "\U00040000")
    ids = smol.encode("a\U00040000b")
    assert ids == hf_ids(smol_hf, "a\U00040000b")
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


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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



@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_smol(smol, text, skip):
    ids = smol.encode(text)
    deltas = stream_deltas(smol, ids, skip)
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


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_stream_decoder_drawn_text(smol, text):
    assume(spellable(smol, text))
    ids = smol.encode(text)
    deltas = stream_deltas(smol, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


# ----------------------------------------------------------------------------------------------
# pre-tokenizer patterns per tokenizer.ggml.pre
# ----------------------------------------------------------------------------------------------


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    alphabet = {c: b for b, c in _byte_alphabet().items()}
    return [bytes(alphabet[c] for c in p).decode("utf-8", "replace") for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def _byte_alphabet():
    return BYTE_TO_CHAR


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
        out[pre] = (Tokenizer.from_gguf_metadata(gguf_metadata(path)), hf_gguf_tokenizer(path))
    return out


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_variants_match_transformers(pre_variants, pre):
    mine, hf = pre_variants[pre]
    for text in CORPUS:
        assert mine.encode(text) == hf_ids(hf, text), text


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_pre_variants_drawn_text(pre_variants, pre, text):
    mine, hf = pre_variants[pre]
    ids = mine.encode(text)
    assert ids == hf_ids(hf, text)
    assert mine.decode(ids) == (text if spellable(mine, text) else hf.decode(ids))
