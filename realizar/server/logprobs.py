"""Token log-probabilities in OpenAI's two shapes, from the ``logprob``/``top_logprobs`` of
:class:`~realizar.generation.TokenChunk` s.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (parallel lists; each
``top_logprobs`` entry a ``{token text: logprob}`` dict). Chat: ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``. A token that is only
part of a UTF-8 character shows as ``bytes:\\xNN...`` in text and with its exact ``bytes``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Sequence

__all__ = ["TokenTexts", "completion_logprobs", "chat_logprobs"]

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet (printable stand-ins for the 256 byte values), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Text and exact bytes of single token ids for one tokenizer (cached: a vocabulary is finite)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._piece(token_id)
        return hit

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        raw = self._raw_bytes(token_id)
        if raw is None:
            return text, text.encode("utf-8")
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a vocabulary entry that is not whole UTF-8: byte-level BPE (GPT-2 alphabet)
        or a SentencePiece byte token ``<0xNN>``; None when neither applies."""
        spelled = getattr(self.tokenizer, "id_to_token", lambda _: None)(token_id)
        if not spelled:
            return None
        m = _SPM_BYTE.fullmatch(spelled)
        if m:
            return bytes([int(m.group(1), 16)])
        table = _gpt2_byte_decoder()
        if all(c in table for c in spelled):
            return bytes(table[c] for c in spelled)
        return None


def completion_logprobs(texts: TokenTexts, chunks: Sequence[Any], start_offset: int = 0) -> dict:
    """The completions ``logprobs`` object of ``chunks``; ``text_offset`` counts characters of the
    choice's text from ``start_offset`` (the length of what precedes the first chunk's text)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = start_offset
    for c in chunks:
        tokens.append(texts.piece(c.token_id)[0])
        token_lps.append(c.logprob)
        top: dict[str, float] = {}
        for tid, lp in c.top_logprobs or ():
            top.setdefault(texts.piece(tid)[0], lp)  # two ids may spell the same text: keep the likelier
        tops.append(top)
        offsets.append(offset)
        offset += len(c.text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    text, raw = texts.piece(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(texts: TokenTexts, chunks: Sequence[Any]) -> dict:
    """The chat ``logprobs`` object of ``chunks``."""
    content = []
    for c in chunks:
        entry = _chat_entry(texts, c.token_id, c.logprob)
        entry["top_logprobs"] = [_chat_entry(texts, tid, lp) for tid, lp in c.top_logprobs or ()]
        content.append(entry)
    return {"content": content, "refusal": None}
