"""SentencePiece-style GGUF tokenizers: ids equal to llama.cpp's rule (transcribed here) and to
transformers' where the two conventions agree; hand-checked merges; streaming decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from realizar.text.tokenizer import Tokenizer
from tests.tokenizer_cases import (  # noqa: F401 - fixtures
    MIXED,
    CORPUS,
    HAND_SCORES,
    HAND_TOKENS,
    HAND_TYPES,
    SPM_EXTRA_CONTROL,
    SPM_EXTRA_USER,
    STREAM_TEXTS,
    gguf_metadata,
    hf_ids,
    stream_deltas,
    write_spm_gguf,
    hand_spm,
    spm,
    spm_files,
    spm_hf,
)
from tests.helpers import examples


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


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
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
    assert ids == hf_ids(spm_hf, text)
    assert spm.decode(ids) == spm_hf.decode(ids)
    assert spm.decode(ids, skip_special_tokens=True) == spm_hf.decode(ids, skip_special_tokens=True)


@pytest.mark.oracle
@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_spm_drawn_text_matches_transformers(spm, spm_hf, text):
    assume(_hf_comparable(text))
    assert spm.encode(text) == hf_ids(spm_hf, text)


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
    deltas = stream_deltas(spm, ids, skip)
    assert "".join(deltas) == spm.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    if skip:
        assert "".join(deltas) == text.replace("</s>", "").replace(SPM_EXTRA_CONTROL, "")



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
    write_spm_gguf(path, HAND_TOKENS, HAND_SCORES, HAND_TYPES, add_space_prefix=False, add_bos=False)
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(path))
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
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(path))
    t = HAND_TOKENS.index
    assert tok.encode("hello", add_special_tokens=False) == [t("\u2581he"), t("ll"), t("o")]


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_decoder_spm_any_ids(spm, data):
    # byte tokens in an impossible order make the library rewrite text it already decoded; the
    # stream carries on, and wherever the ids spell valid UTF-8 it equals decode()
    ids = data.draw(st.lists(st.integers(0, spm.vocab_size - 1), max_size=10))
    for skip in (False, True):
        text = "".join(stream_deltas(spm, ids, skip))
        full = spm.decode(ids, skip_special_tokens=skip)
        if "\ufffd" not in full:
            assert text == full
