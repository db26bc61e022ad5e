"""Tokenizers from a Hugging Face ``tokenizer.json``, and malformed GGUF tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from realizar.errors import TokenizerError
from realizar.text.tokenizer import Tokenizer
from tests.tokenizer_cases import (  # noqa: F401 - fixtures
    CORPUS,
    HAND_SCORES,
    HAND_TOKENS,
    HAND_TYPES,
    STREAM_TEXTS,
    hf_ids,
    stream_deltas,
    smol,
    smol_hf,
    smol_md,
    smol_path,
    spm,
    spm_files,
)


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
        assert ids == hf_ids(smol_hf, text), text
        assert tok.decode(ids) == smol_hf.decode(ids)
        assert "".join(stream_deltas(tok, ids)) == tok.decode(ids)


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
    assert tok.decode([tok.token_to_id("<0x41>")]) == "A"
    for text in STREAM_TEXTS + ["hello world", " lead"]:
        ids = tok.encode(text)
        assert ids == spm.encode(text)
        assert tok.decode(ids) == spm.decode(ids)
        assert "".join(stream_deltas(tok, ids)) == tok.decode(ids)


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
    assert "".join(stream_deltas(tok, ids)) == "hello world hé"


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
