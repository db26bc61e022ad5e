"""Text ↔ token ids for one model: a thin facade over a ``tokenizers.Tokenizer``.

The library tokenizer comes from a GGUF file's metadata (translated in
:mod:`realizar.text.gguf_vocab`) or from a Hugging Face ``tokenizer.json``. Encoding, decoding,
BOS/EOS insertion (a ``TemplateProcessing`` post-processor) and streaming detokenization
(``tokenizers.decoders.DecodeStream``) are the library's; the facade adds typed errors, the
model's end-of-generation ids and its chat template.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers as tk
from tokenizers import AddedToken
from tokenizers.decoders import DecodeStream

from realizar.errors import TokenizerError
from realizar.text import gguf_vocab
from realizar.models.chat_template import chat_template_from_hf
from realizar.text.chat import render_chat

__all__ = ["Tokenizer", "StreamDecoder"]


class StreamDecoder:
    """Turns token ids, fed one at a time, into text deltas (``tokenizers``' ``DecodeStream``).

    Text that ends in an incomplete UTF-8 character is held back until the rest arrives;
    :meth:`flush` releases whatever is left at the end (an incomplete sequence as U+FFFD). The
    concatenation of all deltas plus the flush equals ``tokenizer.decode(ids)`` for any ids that
    spell valid UTF-8.

    Invalid UTF-8 (ids a model sampled in an impossible order) can make the library's decoder
    rewrite text it already produced (SentencePiece byte tokens decode as a group, one U+FFFD per
    byte); text already handed out cannot be taken back, so the stream then starts afresh at that
    token (with the one before as context) and carries on.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._restart()

    def _restart(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._ids: list[int] = []  # ids fed since the (re)start, for the decode of a held-back tail
        self._emitted: list[str] = []
        self._held = False  # the last ids fed have not produced text yet

    def step(self, token_id: int) -> str:
        """Feed one id; returns the text it completes (possibly ``""``)."""
        tid = self._tokenizer._library_id(token_id)
        backend = self._tokenizer.backend
        try:
            text = self._stream.step(backend, tid)
        except Exception:  # the library's "invalid prefix": the decoded window changed behind us
            text = self._restart_at(tid)
        self._ids.append(tid)
        self._held = text is None
        if text:
            self._emitted.append(text)
        return text or ""

    def _restart_at(self, tid: int) -> str | None:
        """A fresh stream with the previous id as context (its text, if any, is out already; held
        bytes of it come out with ``tid``'s text), then ``tid``; without context if that fails too."""
        backend = self._tokenizer.backend
        prev = self._ids[-1:]
        self._restart()
        if prev:
            done = self._stream.step(backend, prev[0])
            self._ids = prev
            self._emitted = [done] if done else []
            try:
                return self._stream.step(backend, tid)
            except Exception:
                self._restart()
        return self._stream.step(backend, tid)

    def feed(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; returns the text they complete."""
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """End of the stream: the text still held back (incomplete bytes become U+FFFD)."""
        if not self._held:
            return ""
        full = self._tokenizer.backend.decode(self._ids, skip_special_tokens=self._skip)
        done = "".join(self._emitted)
        self._restart()
        return full[len(done) :] if full.startswith(done) else ""


class Tokenizer:
    """Text ↔ token ids for one model. Build it with :meth:`from_gguf_metadata` or
    :meth:`from_tokenizer_json`."""

    def __init__(
        self,
        backend: tk.Tokenizer,
        *,
        kind: str,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        aliases: Mapping[int, int] | None = None,
    ):
        self._backend = backend
        self._backend_literal: tk.Tokenizer | None = None  # special tokens not parsed
        self._lock = threading.Lock()
        self.kind = kind  # "bpe" (byte-level), "spm" (SentencePiece-style) or "json"
        self._vocab_size = int(vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True))
        # ids whose spelling a later id repeats: the library knows only the later one
        self._aliases = dict(aliases or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids if i is not None))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self._special_ids = frozenset(i for i, a in backend.get_added_tokens_decoder().items() if a.special)
        # chat messages' text is encoded with control tokens as plain text unless this is set (the server's
        # --allow-special-tokens-in-content): see realizar.text.chat_ids
        self.special_tokens_in_content = False

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.*`` keys, python values)."""
        v = gguf_vocab.from_gguf_metadata(metadata)
        return cls(
            v.backend,
            kind=v.kind,
            vocab_size=v.vocab_size,
            bos_token_id=v.bos_token_id,
            eos_token_ids=v.eos_token_ids,
            pad_token_id=v.pad_token_id,
            unk_token_id=v.unk_token_id,
            add_bos=v.add_bos,
            add_eos=v.add_eos,
            chat_template=v.chat_template,
            aliases=v.aliases,
        )

    @classmethod
    def from_tokenizer_json(
        cls,
        path: str | os.PathLike,
        tokenizer_config: Mapping[str, Any] | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
    ) -> "Tokenizer":
        """Load a HF ``tokenizer.json``. ``tokenizer_config`` (the parsed ``tokenizer_config.json``)
        supplies the BOS/EOS/pad tokens, ``add_bos_token``/``add_eos_token`` and the chat template
        (see :func:`realizar.models.chat_template.chat_template_from_hf`). ``eos_token_ids`` adds end-of-sequence
        ids (e.g. from ``generation_config.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"cannot load {path}: {e}") from e
        backend.no_truncation()  # a tokenizer.json may carry training-time truncation/padding settings
        backend.no_padding()
        cfg = dict(tokenizer_config or {})
        _mark_config_special_tokens(backend, cfg)

        def token_id(v: Any) -> int | None:
            if isinstance(v, Mapping):
                v = v.get("content")
            return backend.token_to_id(v) if isinstance(v, str) and v else None

        bos, eos = token_id(cfg.get("bos_token")), token_id(cfg.get("eos_token"))
        eog = [eos, *(eos_token_ids or ())]
        eog += [i for i, a in backend.get_added_tokens_decoder().items()
                if a.special and a.content in gguf_vocab.END_OF_GENERATION_TEXTS]  # fmt: skip
        add_bos = bool(cfg.get("add_bos_token", False))
        add_eos = bool(cfg.get("add_eos_token", False))
        if add_bos and bos is None:
            raise TokenizerError("tokenizer_config sets add_bos_token but names no bos_token in the vocabulary")
        if add_eos and eos is None:
            raise TokenizerError("tokenizer_config sets add_eos_token but names no eos_token in the vocabulary")
        if "add_bos_token" in cfg or "add_eos_token" in cfg:  # the config overrides the file's own
            backend.post_processor = gguf_vocab.special_tokens_processor(backend, bos, eos, add_bos, add_eos)
        return cls(
            backend,
            kind="json",
            bos_token_id=bos,
            eos_token_ids=eog,
            pad_token_id=token_id(cfg.get("pad_token")),
            unk_token_id=token_id(cfg.get("unk_token")),
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=chat_template_from_hf(path.parent, cfg),
        )

    # -- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as the library spells it (byte-level vocabularies
        in the GPT-2 byte alphabet), or None."""
        try:
            return self._backend.id_to_token(self._library_id(token_id))
        except TokenizerError:
            return None

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` (the last one, if repeated), or None."""
        return self._backend.token_to_id(token)

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
    def backend(self) -> tk.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._backend

    # -- encoding -------------------------------------------------------------------------------

    def _literal_backend(self) -> tk.Tokenizer:
        with self._lock:
            if self._backend_literal is None:
                t = tk.Tokenizer.from_str(self._backend.to_str())
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
        try:
            # the library's batch call releases Python's global lock while it works (its single-text
            # call does not), so encoding a long text on a worker thread never stalls the server's loop
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as e:  # e.g. lone surrogates
            raise TokenizerError(f"cannot encode text: {e}") from e

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True, parse_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens, parse_special) for t in texts]

    # -- decoding -------------------------------------------------------------------------------

    def _library_id(self, token_id: Any) -> int:
        """``token_id`` checked against the vocabulary, as the id the library knows."""
        try:
            if isinstance(token_id, bool):
                raise TypeError
            tid = int(token_id)
            if tid != token_id:
                raise TypeError
        except (TypeError, ValueError):
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= tid < self._vocab_size:
            raise TokenizerError(f"token id {tid} is outside the vocabulary of {self._vocab_size} tokens")
        return self._aliases.get(tid, tid)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` (one per generated sequence)."""
        return StreamDecoder(self, skip_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` control tokens are left out."""
        ids = [self._library_id(i) for i in ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

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
        """Render ``messages`` with the model's chat template (see :func:`realizar.text.chat.render_chat`);
        with ``tokenize=True`` return the ids (the control tokens the template writes parsed, no BOS/EOS added
        beyond what it writes, as transformers does; control-token text inside the messages stays plain text
        unless ``special_tokens_in_content``: :mod:`realizar.text.chat_ids`)."""
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        for name in ("pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                special[name] = value
        special.update(kwargs)

        def render(msgs):
            return render_chat(chat_template if chat_template is not None else self.chat_template, msgs,
                               add_generation_prompt=add_generation_prompt, fallback_chatml=fallback_chatml, **special)

        if not tokenize:
            return render(messages)
        if self.special_tokens_in_content:
            return self.encode(render(messages), add_special_tokens=False, parse_special=True)
        from realizar.text.chat_ids import chat_ids

        specials = [a.content for a in self._backend.get_added_tokens_decoder().values() if a.special]
        return chat_ids(render, lambda text, parse: self.encode(text, add_special_tokens=False, parse_special=parse),
                        messages, specials)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos})"
        )


def _mark_config_special_tokens(backend: tk.Tokenizer, cfg: Mapping[str, Any]) -> None:
    """Tokens that ``tokenizer_config.json``'s ``added_tokens_decoder`` calls special are special
    to the library too (transformers does the same), so that decoding can skip them."""
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if not (isinstance(entry, Mapping) and entry.get("special") and isinstance(entry.get("content"), str)):
            continue
        try:
            tid = int(key)
        except ValueError:
            continue
        added = backend.get_added_tokens_decoder().get(tid)
        if backend.token_to_id(entry["content"]) == tid and not (added is not None and added.special):
            backend.add_special_tokens([AddedToken(entry["content"], special=True, normalized=False)])
