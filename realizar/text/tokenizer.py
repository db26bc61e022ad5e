"""Tokenizers: from GGUF metadata (byte-level BPE and SentencePiece-style) or from ``tokenizer.json``.

Everything is built on the ``tokenizers`` library; this module only translates a model file's
description of its tokenizer into ``tokenizers`` components, the way llama.cpp reads the same
metadata:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE over ``tokens`` + ``merges``. Text is first cut
  into words by the regular expressions llama.cpp uses for the ``tokenizer.ggml.pre`` value (see
  :data:`PRE_TOKENIZER_SPLITS`), then mapped to the GPT-2 byte alphabet.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE. Spaces become ``▁``, a ``▁`` is put in
  front of the text (unless ``tokenizer.ggml.add_space_prefix`` is false), pairs are merged best
  score first (the merges are derived from ``tokens`` + ``scores`` when the file has none), and a
  character with no token falls back to its UTF-8 bytes as ``<0xNN>`` tokens.

Control tokens (``token_type`` 3) and user-defined tokens (4) are matched whole in the input text,
control ones only when ``parse_special`` is true; user-defined ones always, as llama.cpp does.

Decoding goes through a per-token byte table (GPT-2 byte alphabet, ``▁`` → space, ``<0xNN>`` →
byte) so that :class:`StreamDecoder` can hand out text deltas that never split a UTF-8 character,
and ``decode(ids)`` is, by construction, the concatenation of those deltas. Tokenizers loaded from
a ``tokenizer.json`` with a decoder this module does not recognise fall back to the library's
``decode`` and a prefix-diff stream decoder.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from realizar.errors import TokenizerError

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "PRE_TOKENIZER_SPLITS",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

try:  # a hard dependency; without it, building a tokenizer raises TokenizerError instead of this import
    import tokenizers as _tk
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
except ImportError as _e:  # pragma: no cover - tokenizers is a hard dependency
    _tk = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

# llama.cpp's token types (gguf ``tokenizer.ggml.token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

_SPACE_MARK = "\u2581"  # ▁, SentencePiece's visible space

# ----------------------------------------------------------------------------------------------
# Pre-tokenizer regular expressions, by ``tokenizer.ggml.pre``
# ----------------------------------------------------------------------------------------------
# Each entry is a sequence of patterns applied one after the other; every match and every span
# between matches becomes its own piece ("isolated" splitting), as in llama.cpp's
# unicode_regex_split. Where llama.cpp rewrote a pattern only to suit std::regex (``(?i:'s|...)``
# spelled out as ``'[sS]|...``) we keep the original pattern of the model's tokenizer.json.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PUNCT_RUN = r"[\p{P}\$\+<=>\^~\|]+"
_DIGITS3 = r"[0-9][0-9][0-9]"


def _names(names: str, splits: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {name: splits for name in names.split()}


#: ``tokenizer.ggml.pre`` → the split patterns llama.cpp applies for it (in order).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for files without a pre-tokenizer name: punctuation runs, GPT-2 words,
    # digit runs, then digit runs cut into threes.
    "default": (_PUNCT_RUN, _GPT2, r"\p{N}+", _DIGITS3),
    **_names(
        "gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "mpt olmo jais trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe",
        (_GPT2,),
    ),
    # single digits first, then the GPT-2 pattern
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", (r"\p{N}", _GPT2)),
    "falcon": (_PUNCT_RUN, _GPT2, _DIGITS3),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx smaug-bpe "
        "glm4 chatglm-bpe",
        (_LLAMA3,),
    ),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", (_GPT4O,)),
    "tekken": (_TEKKEN,),
}

# llama.cpp's per-pre-tokenizer flags: whole words found in the vocabulary skip the merges
# (``ignore_merges``), and BOS is added unless the file says otherwise.
_IGNORE_MERGES = frozenset(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano tekken".split()
)
_ADD_BOS_BY_DEFAULT = frozenset(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano tekken chameleon".split()
)

# Control tokens that end a turn even when the file names another EOS (llama.cpp's EOG list).
_END_OF_GENERATION_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # <｜end▁of▁sentence｜> (DeepSeek)
        "<|return|>",
        "<|call|>",
    ]
)


# ----------------------------------------------------------------------------------------------
# The GPT-2 byte alphabet
# ----------------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters: printable Latin-1
    bytes stand for themselves, the other 68 take the code points from U+0100 upwards in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _to_byte_level(text: str) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


def _in_byte_alphabet(text: str) -> bool:
    return all(c in _CHAR_TO_BYTE for c in text)


def _parse_byte_token(text: str) -> int | None:
    """``"<0x4A>"`` → 0x4A; anything else → None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


# ----------------------------------------------------------------------------------------------
# Stream decoding
# ----------------------------------------------------------------------------------------------


class StreamDecoder:
    """Turns token ids, fed one at a time, into text deltas.

    Bytes of a multi-byte UTF-8 character that is not complete yet are held back until the rest
    arrives; :meth:`flush` releases whatever is left at the end (an incomplete sequence as U+FFFD).
    The concatenation of all deltas plus the flush equals ``tokenizer.decode(ids)``.

    Invalid UTF-8 (ids a model sampled in an impossible order) becomes one U+FFFD per maximal
    invalid subsequence, as in the ``tokenizers`` byte-level decoder; its SentencePiece decoder
    (ByteFallback) writes one U+FFFD per byte token instead, so there -- and only for invalid
    byte sequences -- the count of U+FFFD may differ from transformers' ``decode``.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._table = tokenizer._piece_bytes()
        self._special = tokenizer._special_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_first_space = tokenizer._strip_leading_space
        self._started = False  # a byte has been produced (the leading-space strip only applies before)
        # generic fallback (tokenizer.json with an unrecognised decoder): prefix-diff over decode()
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._text_out: list[str] = []

    def step(self, token_id: int) -> str:
        """Feed one id; returns the text it completes (possibly ``""``)."""
        tid = self._tokenizer._check_id(token_id)
        if self._table is None:
            self.ids.append(tid)
            return self._generic_step()
        if self._skip and tid in self._special:
            return ""
        piece = self._table[tid]
        if not piece:
            return ""
        if not self._started:
            self._started = True
            if self._strip_first_space and piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def feed(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; returns the text they complete."""
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """End of the stream: the text still held back (incomplete bytes become U+FFFD)."""
        if self._table is None:
            full = self._tokenizer._library_decode(self.ids, self._skip)
            done = "".join(self._text_out)
            self._text_out = [full]
            return full[len(done) :] if full.startswith(done) else ""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

    def _generic_step(self) -> str:
        decode = self._tokenizer._library_decode
        before = decode(self.ids[self._prefix : self._read], self._skip)
        now = decode(self.ids[self._prefix :], self._skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            delta = now[len(before) :]
            self._text_out.append(delta)
            return delta
        return ""


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


def _require_tokenizers() -> None:
    if _IMPORT_ERROR is not None:  # pragma: no cover
        raise TokenizerError(f"the 'tokenizers' package is required: {_IMPORT_ERROR}")


def _as_list(md: Mapping[str, Any], key: str, required: bool = True) -> list | None:
    v = md.get(key)
    if v is None:
        if required:
            raise TokenizerError(f"GGUF metadata lacks {key!r}")
        return None
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise TokenizerError(f"GGUF metadata {key!r} is not an array (got {type(v).__name__})")
    return list(v)


def _opt_id(md: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    v = md.get(key)
    if v is None or isinstance(v, bool):
        return None
    try:
        v = int(v)
    except (TypeError, ValueError):
        raise TokenizerError(f"GGUF metadata {key!r} = {v!r} is not a token id") from None
    if v < 0 or v >= n_vocab:
        # llama.cpp uses -1 (or an out-of-range id) for "none"; treat it the same way
        if v == -1 or v == 0xFFFFFFFF:
            return None
        raise TokenizerError(f"GGUF metadata {key!r} = {v} is outside the vocabulary of {n_vocab} tokens")
    return v


def _opt_bool(md: Mapping[str, Any], key: str) -> bool | None:
    v = md.get(key)
    return None if v is None else bool(v)


class Tokenizer:
    """Text ↔ token ids for one model. Build it with :meth:`from_gguf_metadata` or
    :meth:`from_tokenizer_json`."""

    def __init__(
        self,
        backend: "_tk.Tokenizer",
        *,
        kind: str,
        tokens: Sequence[str],
        special_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        use_post_processor: bool = False,
        strip_leading_space: bool = False,
        chat_template: str | None = None,
        piece_bytes: list[bytes] | None = None,
    ):
        self._backend = backend
        self._backend_literal: "_tk.Tokenizer | None" = None  # special tokens not parsed
        self._lock = threading.Lock()
        self.kind = kind  # "bpe" (byte-level), "spm" (SentencePiece-style) or "json"
        self._tokens = list(tokens)
        self._token_ids: dict[str, int] | None = None
        self._special_ids = frozenset(int(i) for i in special_ids)
        self.bos_token_id = bos_token_id
        eos = []
        for i in eos_token_ids:
            if i is not None and int(i) not in eos:
                eos.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._use_post_processor = use_post_processor
        self._strip_leading_space = strip_leading_space
        self.chat_template = chat_template
        self._piece_table = piece_bytes

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.*`` keys, python values)."""
        _require_tokenizers()
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("GGUF metadata lacks 'tokenizer.ggml.model': the file carries no tokenizer")
        tokens = _as_list(metadata, "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.tokens' is empty")
        if not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.tokens' holds non-string entries")
        n = len(tokens)
        types = _as_list(metadata, "tokenizer.ggml.token_type", required=False)
        if types is None:
            types = [TOKEN_TYPE_NORMAL] * n
        if len(types) != n:
            raise TokenizerError(f"GGUF metadata has {len(types)} token types for {n} tokens")
        try:
            types = [int(t) for t in types]
        except (TypeError, ValueError):
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.token_type' holds non-integer entries") from None

        if model == "gpt2":
            tk, pieces, strip, add_bos_default = cls._build_byte_level(metadata, tokens, types)
            kind = "bpe"
        elif model == "llama":
            tk, pieces, strip, add_bos_default = cls._build_sentencepiece(metadata, tokens, types)
            kind = "spm"
        else:
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece-style BPE)"
            )

        bos = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n)
        eos = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n)
        eot = _opt_id(metadata, "tokenizer.ggml.eot_token_id", n)
        eom = _opt_id(metadata, "tokenizer.ggml.eom_token_id", n)
        pad = _opt_id(metadata, "tokenizer.ggml.padding_token_id", n)
        unk = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n)
        eog = [eos, eot, eom]
        eog += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_TYPE_CONTROL and t in _END_OF_GENERATION_TEXTS]

        add_bos = _opt_bool(metadata, "tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default for this kind of vocabulary, when there is a BOS
            add_bos = add_bos_default and bos is not None
        add_eos = bool(_opt_bool(metadata, "tokenizer.ggml.add_eos_token") or False)
        if add_bos and bos is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but the file names no BOS token")
        if add_eos and eos is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but the file names no EOS token")
        template = metadata.get("tokenizer.chat_template")
        return cls(
            tk,
            kind=kind,
            tokens=tokens,
            special_ids=[i for i, ty in enumerate(types) if ty == TOKEN_TYPE_CONTROL],
            bos_token_id=bos,
            eos_token_ids=[i for i in eog if i is not None],
            pad_token_id=pad,
            unk_token_id=unk,
            add_bos=add_bos,
            add_eos=add_eos,
            strip_leading_space=strip,
            chat_template=template if isinstance(template, str) and template else None,
            piece_bytes=pieces,
        )

    @staticmethod
    def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]] | None:
        raw = _as_list(metadata, "tokenizer.ggml.merges", required=False)
        if raw is None:
            return None
        merges = []
        for m in raw:
            if not isinstance(m, str):
                raise TokenizerError("GGUF metadata 'tokenizer.ggml.merges' holds non-string entries")
            # a merge is "left right"; the pieces never contain a plain space (byte level uses Ġ,
            # SentencePiece ▁), so the first space separates them
            left, sep, right = m.partition(" ")
            if not sep or not left or not right:
                raise TokenizerError(f"malformed merge {m!r} in 'tokenizer.ggml.merges'")
            merges.append((left, right))
        return merges

    @staticmethod
    def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> tuple[list, list]:
        special, user = [], []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if not t:
                continue
            if ty == TOKEN_TYPE_CONTROL:
                special.append((i, AddedToken(t, special=True, normalized=False)))
            elif ty == TOKEN_TYPE_USER_DEFINED:
                user.append((i, AddedToken(t, special=False, normalized=False)))
        return special, user

    @staticmethod
    def _register_added(tk: "_tk.Tokenizer", special: list, user: list) -> None:
        # Every added token's text is a key of the model vocabulary, so the library gives it that
        # entry's id rather than a new one.
        if special:
            tk.add_special_tokens([a for _, a in special])
        if user:
            tk.add_tokens([a for _, a in user])

    @classmethod
    def _build_byte_level(cls, metadata, tokens, types):
        merges = cls._merges(metadata)
        if merges is None:
            raise TokenizerError("GGUF byte-level BPE tokenizer lacks 'tokenizer.ggml.merges'")
        pre = metadata.get("tokenizer.ggml.pre") or "default"
        if not isinstance(pre, str):
            raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.pre' = {pre!r} is not a string")
        splits = PRE_TOKENIZER_SPLITS.get(pre)
        if splits is None:
            warnings.warn(
                f"unknown pre-tokenizer {pre!r} in GGUF metadata; splitting words with the GPT-2 pattern",
                stacklevel=3,
            )
            splits = (_GPT2,)

        # Vocabulary keys are spelled in the byte alphabet; a normal token that is not (some
        # converters store raw UTF-8) is respelled. Control/user-defined tokens keep their raw text:
        # they are matched in the input before the model sees it.
        vocab: dict[str, int] = {}
        pieces: list[bytes] = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            added = ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
            spelled = _in_byte_alphabet(t)
            # a repeated spelling maps to its last id, as in llama.cpp and transformers
            vocab[t if added or spelled else _to_byte_level(t)] = i
            pieces.append(bytes(_CHAR_TO_BYTE[c] for c in t) if spelled and not added else t.encode("utf-8"))

        def respell(p: str) -> str:
            return p if _in_byte_alphabet(p) else _to_byte_level(p)

        merges = [(respell(a), respell(b)) for a, b in merges]
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                ignore_merges=pre in _IGNORE_MERGES,
                unk_token=None,
                fuse_unk=False,
                byte_fallback=False,
            )
        except Exception as e:  # the library raises plain Exception for bad merges
            raise TokenizerError(f"cannot build the BPE model from GGUF metadata: {e}") from e
        tk = _tk.Tokenizer(bpe)
        tk.normalizer = None
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        special, user = cls._added_tokens(tokens, types)
        cls._register_added(tk, special, user)
        return tk, pieces, False, pre in _ADD_BOS_BY_DEFAULT

    @classmethod
    def _build_sentencepiece(cls, metadata, tokens, types):
        n = len(tokens)
        merges = cls._merges(metadata)
        scores = _as_list(metadata, "tokenizer.ggml.scores", required=merges is None)
        if scores is not None:
            if len(scores) != n:
                raise TokenizerError(f"GGUF metadata has {len(scores)} scores for {n} tokens")
            try:
                scores = [float(s) for s in scores]
            except (TypeError, ValueError):
                raise TokenizerError("GGUF metadata 'tokenizer.ggml.scores' holds non-numeric entries") from None
            if any(math.isnan(s) for s in scores):
                raise TokenizerError("GGUF metadata 'tokenizer.ggml.scores' holds NaN")
        vocab = {t: i for i, t in enumerate(tokens)}  # a repeated token maps to its last id
        if merges is None:
            merges = _merges_from_scores(tokens, scores, vocab)
        missing_bytes = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
        if missing_bytes:
            # Without all byte tokens an unknown character cannot be spelled; it becomes <unk>.
            warnings.warn(
                f"SentencePiece vocabulary lacks {len(missing_bytes)} of the 256 <0xNN> byte tokens", stacklevel=3
            )
        unk_id = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n)
        if unk_id is None:
            unk_id = next((i for i, ty in enumerate(types) if ty == TOKEN_TYPE_UNKNOWN), None)
        add_prefix = _opt_bool(metadata, "tokenizer.ggml.add_space_prefix")
        add_prefix = True if add_prefix is None else add_prefix
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=tokens[unk_id] if unk_id is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        except Exception as e:
            raise TokenizerError(f"cannot build the SentencePiece model from GGUF metadata: {e}") from e
        tk = _tk.Tokenizer(bpe)
        # Spaces become ▁ and, with add_space_prefix, a ▁ goes in front of every stretch of text
        # between special tokens (the start of the text included) -- llama.cpp's rule, and that of
        # SentencePiece and of the original ("legacy") HF tokenizer.json of Llama 2 / Mistral.
        # transformers' GGUF loader uses Metaspace(prepend_scheme="first") instead, which differs
        # only for text starting with a space or following a special token.
        steps = [normalizers.Replace(" ", _SPACE_MARK)]
        if add_prefix:
            steps.insert(0, normalizers.Prepend(_SPACE_MARK))
        tk.normalizer = normalizers.Sequence(steps)
        tk.pre_tokenizer = None
        seq = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            seq.append(decoders.Strip(content=" ", left=1, right=0))
        tk.decoder = decoders.Sequence(seq)
        special, user = cls._added_tokens(tokens, types)
        cls._register_added(tk, special, user)
        pieces = []
        for t in tokens:
            b = _parse_byte_token(t)
            pieces.append(bytes([b]) if b is not None else t.replace(_SPACE_MARK, " ").encode("utf-8"))
        return tk, pieces, add_prefix, True

    @classmethod
    def from_tokenizer_json(
        cls,
        path: str | os.PathLike,
        tokenizer_config: Mapping[str, Any] | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
    ) -> "Tokenizer":
        """Load a HF ``tokenizer.json``. ``tokenizer_config`` (the parsed ``tokenizer_config.json``)
        supplies the BOS/EOS/pad tokens, ``add_bos_token``/``add_eos_token`` and the chat template;
        when it has no template, a ``chat_template.jinja`` or ``chat_template.json`` next to the file
        is used. ``eos_token_ids`` adds end-of-sequence ids (e.g. from ``generation_config.json``)."""
        _require_tokenizers()
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            tk = _tk.Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"cannot load {path}: {e}") from e
        tk.no_truncation()  # a tokenizer.json may carry training-time truncation/padding settings
        tk.no_padding()
        cfg = dict(tokenizer_config or {})
        spec = json.loads(tk.to_str())

        def token_text(v: Any) -> str | None:
            if isinstance(v, Mapping):
                v = v.get("content")
            return v if isinstance(v, str) and v else None

        def token_id(v: Any) -> int | None:
            text = token_text(v)
            return tk.token_to_id(text) if text is not None else None

        vocab_size = tk.get_vocab_size(with_added_tokens=True)
        tokens = [tk.id_to_token(i) or "" for i in range(vocab_size)]
        added = spec.get("added_tokens") or []
        special_ids = [a["id"] for a in added if a.get("special")]
        # transformers also marks tokens listed in added_tokens_decoder as special
        for k, v in (cfg.get("added_tokens_decoder") or {}).items():
            if isinstance(v, Mapping) and v.get("special"):
                try:
                    special_ids.append(int(k))
                except ValueError:
                    pass

        bos = token_id(cfg.get("bos_token"))
        eos = token_id(cfg.get("eos_token"))
        pad = token_id(cfg.get("pad_token"))
        unk = token_id(cfg.get("unk_token"))
        eog = [eos, *(eos_token_ids or ())]
        eog += [a["id"] for a in added if a.get("special") and a.get("content") in _END_OF_GENERATION_TEXTS]

        use_post = "add_bos_token" not in cfg and "add_eos_token" not in cfg
        add_bos = bool(cfg.get("add_bos_token", False))
        add_eos = bool(cfg.get("add_eos_token", False))
        if add_bos and bos is None:
            raise TokenizerError("tokenizer_config sets add_bos_token but names no bos_token in the vocabulary")
        if add_eos and eos is None:
            raise TokenizerError("tokenizer_config sets add_eos_token but names no eos_token in the vocabulary")

        template = _template_from_config(cfg.get("chat_template"))
        if template is None:
            template = _template_from_files(path.parent)

        pieces, strip = _json_piece_table(spec, tokens, special_ids)
        return cls(
            tk,
            kind="json",
            tokens=tokens,
            special_ids=special_ids,
            bos_token_id=bos,
            eos_token_ids=[i for i in eog if i is not None],
            pad_token_id=pad,
            unk_token_id=unk,
            add_bos=add_bos,
            add_eos=add_eos,
            use_post_processor=use_post,
            strip_leading_space=strip,
            chat_template=template,
            piece_bytes=pieces,
        )

    # -- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as the model file spells it, or None."""
        try:
            tid = self._check_id(token_id)
        except TokenizerError:
            return None
        return self._tokens[tid]

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` (the last one, if repeated), or None."""
        if self._token_ids is None:
            self._token_ids = {t: i for i, t in enumerate(self._tokens)}
        return self._token_ids.get(token)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> str | None:
        i = self.eos_token_id
        return self.id_to_token(i) if i is not None else None

    @property
    def pad_token(self) -> str | None:
        return self.id_to_token(self.pad_token_id) if self.pad_token_id is not None else None

    @property
    def unk_token(self) -> str | None:
        return self.id_to_token(self.unk_token_id) if self.unk_token_id is not None else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens (skipped by ``decode(..., skip_special_tokens=True)``)."""
        return self._special_ids

    @property
    def backend(self) -> "_tk.Tokenizer":
        """The underlying ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._backend

    # -- encoding -------------------------------------------------------------------------------

    def _literal_backend(self) -> "_tk.Tokenizer":
        with self._lock:
            if self._backend_literal is None:
                t = _tk.Tokenizer.from_str(self._backend.to_str())
                t.encode_special_tokens = True
                self._backend_literal = t
            return self._backend_literal

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds BOS/EOS as the model asks;
        ``parse_special`` matches control tokens written in the text (``"<|im_start|>"``) as those
        tokens — switch it off for untrusted text."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        backend = self._backend if parse_special else self._literal_backend()
        use_post = add_special_tokens and self._use_post_processor
        try:
            ids = backend.encode(text, add_special_tokens=use_post).ids
        except Exception as e:  # e.g. lone surrogates
            raise TokenizerError(f"cannot encode text: {e}") from e
        if add_special_tokens and not self._use_post_processor:
            if self.add_bos:
                ids = [self.bos_token_id, *ids]
            if self.add_eos:
                ids = [*ids, self.eos_token_id]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True, parse_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens, parse_special) for t in texts]

    # -- decoding -------------------------------------------------------------------------------

    def _check_id(self, token_id: Any) -> int:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            tid = int(token_id)
            if tid != token_id:
                raise TypeError
        except (TypeError, ValueError):
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= tid < len(self._tokens):
            raise TokenizerError(f"token id {tid} is outside the vocabulary of {len(self._tokens)} tokens")
        return tid

    def _piece_bytes(self) -> list[bytes] | None:
        return self._piece_table

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes ``token_id`` stands for in decoded text, or None when this tokenizer's decoder
        is not one whose output can be split per token."""
        tid = self._check_id(token_id)
        return None if self._piece_table is None else self._piece_table[tid]

    def _library_decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` (one per generated sequence)."""
        return StreamDecoder(self, skip_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` control tokens are left out."""
        ids = [self._check_id(i) for i in ids]
        if self._piece_table is None:
            return self._library_decode(ids, skip_special_tokens)
        sd = StreamDecoder(self, skip_special_tokens)
        return sd.feed(ids) + sd.flush()

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        chat_template: str | None = None,
        fallback_chatml: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (see :func:`realizar.chat.render_chat`);
        with ``tokenize=True`` return the ids (special tokens in the text parsed, no BOS/EOS added
        beyond what the template writes — as transformers does)."""
        from realizar.chat import render_chat

        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        for name in ("pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                special[name] = value
        special.update(kwargs)
        text = render_chat(
            chat_template if chat_template is not None else self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            fallback_chatml=fallback_chatml,
            **special,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False, parse_special=True)
        return text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos})"
        )


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every way of writing a token as two
    tokens is a merge, ranked by the merged token's score (best first; ties: longer left piece,
    longer right piece, then token order — the order transformers uses). Merging best-ranked
    pairs first is then llama.cpp's SentencePiece rule: merge the adjacent pair that forms the
    highest-scoring token."""
    score_of = dict(zip(tokens, scores))  # a repeated token: first position, last score
    ranked = []
    for t, score in score_of.items():
        if len(t) < 2:
            continue
        local = []
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()
        for li, ri, left, right in local:
            ranked.append((-score, -len(left), -len(right), len(ranked), left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _template_from_config(v: Any) -> str | None:
    if isinstance(v, str):
        return v or None
    if isinstance(v, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {d.get("name"): d.get("template") for d in v if isinstance(d, Mapping)}
        t = named.get("default")
        if t is None and named:
            t = next(iter(named.values()))
        return t if isinstance(t, str) and t else None
    return None


def _template_from_files(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8") or None
    js = directory / "chat_template.json"
    if js.is_file():
        try:
            return _template_from_config(json.loads(js.read_text(encoding="utf-8")).get("chat_template"))
        except (ValueError, AttributeError):
            return None
    return None


def _json_piece_table(spec: Mapping[str, Any], tokens: Sequence[str], special_ids: Sequence[int]):
    """Per-token bytes for the decoders this module understands, else (None, False)."""
    dec = spec.get("decoder") or {}
    added = {a["id"] for a in spec.get("added_tokens") or []}
    kind = dec.get("type")
    if kind == "ByteLevel":
        pieces = []
        for i, t in enumerate(tokens):
            if i in added or not _in_byte_alphabet(t):
                pieces.append(t.encode("utf-8"))
            else:
                pieces.append(bytes(_CHAR_TO_BYTE[c] for c in t))
        return pieces, False
    if kind == "Sequence":
        steps = dec.get("decoders") or []
        types = [d.get("type") for d in steps]
        core = types[:3] == ["Replace", "ByteFallback", "Fuse"]
        rep = steps[0] if steps else {}
        pattern = (rep.get("pattern") or {}).get("String") if core else None
        if core and pattern == _SPACE_MARK and rep.get("content") == " ":
            tail = steps[3:]
            strip = False
            if tail:
                if len(tail) != 1 or tail[0].get("type") != "Strip":
                    return None, False
                s = tail[0]
                if s.get("content") != " " or s.get("start") != 1 or s.get("stop", 0) != 0:
                    return None, False
                strip = True
            pieces = []
            for t in tokens:
                b = _parse_byte_token(t)
                pieces.append(bytes([b]) if b is not None else t.replace(_SPACE_MARK, " ").encode("utf-8"))
            return pieces, strip
    return None, False
