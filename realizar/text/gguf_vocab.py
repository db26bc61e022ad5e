"""Translation of a GGUF file's tokenizer description (``tokenizer.ggml.*``) into a
``tokenizers.Tokenizer``, the way llama.cpp reads the same metadata.

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE over ``tokens`` + ``merges``. Text is first cut
  into words by the regular expressions llama.cpp uses for the ``tokenizer.ggml.pre`` value (see
  :data:`PRE_TOKENIZER_SPLITS`), then mapped to the GPT-2 byte alphabet.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE. Spaces become ``▁``, a ``▁`` is put in
  front of the text (unless ``tokenizer.ggml.add_space_prefix`` is false), pairs are merged best
  score first (the merges are derived from ``tokens`` + ``scores`` when the file has none), and a
  character with no token falls back to its UTF-8 bytes as ``<0xNN>`` tokens.

Control tokens (``token_type`` 3) and user-defined tokens (4) are matched whole in the input text,
control ones only when special tokens are parsed; user-defined ones always, as llama.cpp does.
BOS/EOS are added by a ``TemplateProcessing`` post-processor.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import tokenizers as tk
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from realizar.errors import TokenizerError
from realizar.models.chat_template import chat_template_from_gguf

__all__ = [
    "GGUFVocab",
    "PRE_TOKENIZER_SPLITS",
    "END_OF_GENERATION_TEXTS",
    "from_gguf_metadata",
    "special_tokens_processor",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

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
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PUNCT_RUN = r"[\p{P}\$\+<=>\^~\|]+"
_DIGITS3 = r"[0-9][0-9][0-9]"

#: ``tokenizer.ggml.pre`` → the split patterns llama.cpp applies for it (in order), for the
#: byte-level vocabularies of the supported architectures: SmolLM2 (``smollm``), Llama 3
#: (``llama-bpe``; older converters wrote ``llama3``/``llama-v3``), Qwen2/Qwen3 (``qwen2``) and
#: Mistral's Tekken vocabularies (``tekken``). ``default`` is llama.cpp's rule for files without a
#: name; any other name is warned about and split with the GPT-2 pattern (``gpt-2``).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # punctuation runs, GPT-2 words, digit runs, then digit runs cut into threes
    "default": (_PUNCT_RUN, _GPT2, r"\p{N}+", _DIGITS3),
    "gpt-2": (_GPT2,),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # single digits first, then the GPT-2 pattern
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "tekken": (_TEKKEN,),
}

# llama.cpp's per-pre-tokenizer flags: whole words found in the vocabulary skip the merges
# (``ignore_merges``), and BOS is added unless the file says otherwise.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "tekken"})
_ADD_BOS_BY_DEFAULT = _IGNORE_MERGES

#: Control tokens that end a turn even when the file names another EOS (llama.cpp's EOG list).
END_OF_GENERATION_TEXTS = frozenset(
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

_BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())
_TO_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def _byte_level_spelling(text: str) -> str:
    """``text`` in the GPT-2 byte alphabet (unchanged when it is spelled that way already)."""
    if not text or all(c in _BYTE_ALPHABET for c in text):
        return text
    return "".join(p for p, _ in _TO_BYTE_LEVEL.pre_tokenize_str(text))


@dataclass
class GGUFVocab:
    """What a GGUF file says about its tokenizer, as a library tokenizer plus the facts the
    facade needs (ids are the file's; ``aliases`` maps a token whose spelling a later token repeats
    to that later id, which is the one the library knows)."""

    backend: tk.Tokenizer
    kind: str  # "bpe" (byte-level) or "spm" (SentencePiece-style)
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    aliases: dict[int, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# metadata readers
# ----------------------------------------------------------------------------------------------


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


def _tokens_and_types(md: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    tokens = _as_list(md, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.tokens' is empty")
    if not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.tokens' holds non-string entries")
    n = len(tokens)
    types = _as_list(md, "tokenizer.ggml.token_type", required=False)
    if types is None:
        types = [TOKEN_TYPE_NORMAL] * n
    if len(types) != n:
        raise TokenizerError(f"GGUF metadata has {len(types)} token types for {n} tokens")
    try:
        types = [int(t) for t in types]
    except (TypeError, ValueError):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.token_type' holds non-integer entries") from None
    return tokens, types


def _merges(md: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    raw = _as_list(md, "tokenizer.ggml.merges", required=False)
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


def _scores(md: Mapping[str, Any], n: int, required: bool) -> list[float] | None:
    scores = _as_list(md, "tokenizer.ggml.scores", required=required)
    if scores is None:
        return None
    if len(scores) != n:
        raise TokenizerError(f"GGUF metadata has {len(scores)} scores for {n} tokens")
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.scores' holds non-numeric entries") from None
    if any(math.isnan(s) for s in scores):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.scores' holds NaN")
    return scores


# ----------------------------------------------------------------------------------------------
# building the library tokenizer
# ----------------------------------------------------------------------------------------------


def _vocab(keys: Sequence[str]) -> tuple[dict[str, int], dict[int, int]]:
    """Vocabulary ``key → id`` (a repeated key maps to its last id, as in llama.cpp and
    transformers) and the aliases of the ids it shadows."""
    vocab = {k: i for i, k in enumerate(keys)}
    aliases = {i: vocab[k] for i, k in enumerate(keys) if vocab[k] != i}
    return vocab, aliases


def _register_added(backend: tk.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    # Every added token's text is a key of the model vocabulary, so the library gives it that
    # entry's id rather than a new one.
    special = [t for t, ty in zip(tokens, types) if t and ty == TOKEN_TYPE_CONTROL]
    user = [t for t, ty in zip(tokens, types) if t and ty == TOKEN_TYPE_USER_DEFINED]
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _build_byte_level(md: Mapping[str, Any], tokens: list[str], types: list[int]):
    merges = _merges(md)
    if merges is None:
        raise TokenizerError("GGUF byte-level BPE tokenizer lacks 'tokenizer.ggml.merges'")
    pre = md.get("tokenizer.ggml.pre") or "default"
    if not isinstance(pre, str):
        raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.pre' = {pre!r} is not a string")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        warnings.warn(
            f"unknown pre-tokenizer {pre!r} in GGUF metadata; splitting words with the GPT-2 pattern",
            stacklevel=4,
        )
        splits = PRE_TOKENIZER_SPLITS["gpt-2"]
    # Vocabulary keys are spelled in the byte alphabet; a normal token that is not (some converters
    # store raw UTF-8) is respelled. Control/user-defined tokens keep their raw text: they are
    # matched in the input before the model sees it.
    added = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    keys = [t if ty in added else _byte_level_spelling(t) for t, ty in zip(tokens, types)]
    vocab, aliases = _vocab(keys)
    merges = [(_byte_level_spelling(a), _byte_level_spelling(b)) for a, b in merges]
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES,
                         unk_token=None, fuse_unk=False, byte_fallback=False)  # fmt: skip
    except Exception as e:  # the library raises plain Exception for bad merges
        raise TokenizerError(f"cannot build the BPE model from GGUF metadata: {e}") from e
    backend = tk.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _register_added(backend, tokens, types)
    return backend, aliases, pre in _ADD_BOS_BY_DEFAULT


def _build_sentencepiece(md: Mapping[str, Any], tokens: list[str], types: list[int]):
    n = len(tokens)
    merges = _merges(md)
    scores = _scores(md, n, required=merges is None)
    vocab, aliases = _vocab(tokens)
    if merges is None:
        merges = _merges_from_scores(tokens, scores, vocab)
    missing_bytes = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing_bytes:
        # Without all byte tokens an unknown character cannot be spelled; it becomes <unk>.
        warnings.warn(
            f"SentencePiece vocabulary lacks {len(missing_bytes)} of the 256 <0xNN> byte tokens", stacklevel=4
        )
    unk_id = _opt_id(md, "tokenizer.ggml.unknown_token_id", n)
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == TOKEN_TYPE_UNKNOWN), None)
    add_prefix = _opt_bool(md, "tokenizer.ggml.add_space_prefix")
    add_prefix = True if add_prefix is None else add_prefix
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                         fuse_unk=True, byte_fallback=True)  # fmt: skip
    except Exception as e:
        raise TokenizerError(f"cannot build the SentencePiece model from GGUF metadata: {e}") from e
    backend = tk.Tokenizer(bpe)
    # Spaces become ▁ and, with add_space_prefix, a ▁ goes in front of every stretch of text
    # between special tokens (the start of the text included) -- llama.cpp's rule, and that of
    # SentencePiece and of the original ("legacy") HF tokenizer.json of Llama 2 / Mistral.
    # transformers' GGUF loader uses Metaspace(prepend_scheme="first") instead, which differs
    # only for text starting with a space or following a special token.
    steps = [normalizers.Replace(" ", _SPACE_MARK)]
    if add_prefix:
        steps.insert(0, normalizers.Prepend(_SPACE_MARK))
    backend.normalizer = normalizers.Sequence(steps)
    seq = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        seq.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(seq)
    _register_added(backend, tokens, types)
    return backend, aliases, True


def special_tokens_processor(
    backend: tk.Tokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """The post-processor that puts BOS in front of and EOS after an encoded text, as asked."""
    single: list[str] = ["$A"]
    special: list[tuple[str, int]] = []
    for wanted, tid, at_end in ((add_bos, bos, False), (add_eos, eos, True)):
        if wanted and tid is not None:
            text = backend.id_to_token(tid) or f"<{tid}>"
            single = [*single, text] if at_end else [text, *single]
            if all(t != text for t, _ in special):
                special.append((text, tid))
    return processors.TemplateProcessing(single=single, special_tokens=special)


def from_gguf_metadata(md: Mapping[str, Any]) -> GGUFVocab:
    """The tokenizer a GGUF file describes (``tokenizer.ggml.*`` keys, python values)."""
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("GGUF metadata lacks 'tokenizer.ggml.model': the file carries no tokenizer")
    tokens, types = _tokens_and_types(md)
    if model == "gpt2":
        backend, aliases, add_bos_default = _build_byte_level(md, tokens, types)
        kind = "bpe"
    elif model == "llama":
        backend, aliases, add_bos_default = _build_sentencepiece(md, tokens, types)
        kind = "spm"
    else:
        raise TokenizerError(
            f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece-style BPE)"
        )
    n = len(tokens)
    bos = _opt_id(md, "tokenizer.ggml.bos_token_id", n)
    eos = _opt_id(md, "tokenizer.ggml.eos_token_id", n)
    eog = [eos, _opt_id(md, "tokenizer.ggml.eot_token_id", n), _opt_id(md, "tokenizer.ggml.eom_token_id", n)]
    eog += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_TYPE_CONTROL and t in END_OF_GENERATION_TEXTS]
    add_bos = _opt_bool(md, "tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default for this kind of vocabulary, when there is a BOS
        add_bos = add_bos_default and bos is not None
    add_eos = bool(_opt_bool(md, "tokenizer.ggml.add_eos_token") or False)
    if add_bos and bos is None:
        raise TokenizerError("tokenizer.ggml.add_bos_token is true but the file names no BOS token")
    if add_eos and eos is None:
        raise TokenizerError("tokenizer.ggml.add_eos_token is true but the file names no EOS token")
    if add_bos or add_eos:
        backend.post_processor = special_tokens_processor(backend, bos, eos, add_bos, add_eos)
    template = chat_template_from_gguf(md)
    return GGUFVocab(
        backend=backend,
        kind=kind,
        vocab_size=n,
        bos_token_id=bos,
        eos_token_ids=[i for i in eog if i is not None],
        pad_token_id=_opt_id(md, "tokenizer.ggml.padding_token_id", n),
        unk_token_id=_opt_id(md, "tokenizer.ggml.unknown_token_id", n),
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template,
        aliases=aliases,
    )


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
