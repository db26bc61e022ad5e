"""Chat prompts as token ids where the *messages'* text never becomes control tokens.

A chat template writes control tokens (``<|im_start|>``, ``<|im_end|>``) around each message; encoding the
rendered prompt with special tokens parsed would also turn control-token *text inside a message* into those
tokens, letting a user close their turn and open a ``system`` one. :func:`chat_ids` renders the template once
with each string that carries such text replaced by a sentinel, encodes the template's own pieces with control
tokens parsed and those strings as plain text, and joins the ids. Prompts whose messages carry no control-token
text encode exactly as before (the whole rendered text at once). A template that changes or repeats a sentinel
(so the message's text cannot be placed) is refused rather than encoded unsafely.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from realizar.errors import TokenizerError

__all__ = ["chat_ids"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # (private-use characters: no template or tokenizer gives them meaning)


def _strings(messages: Sequence[Mapping[str, Any]]):
    """(message index, key path, text) of every string a message's content parts or content carry."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            yield i, ("content",), content
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    yield i, ("content", j, "text"), part["text"]


def _replace(messages: list, path: tuple, i: int, value: str) -> None:
    if len(path) == 1:
        messages[i] = {**messages[i], "content": value}
    else:
        parts = list(messages[i]["content"])
        parts[path[1]] = {**parts[path[1]], "text": value}
        messages[i] = {**messages[i], "content": parts}


def chat_ids(render: Callable[[Sequence[Mapping[str, Any]]], str], encode: Callable[[str, bool], list[int]],
             messages: Sequence[Mapping[str, Any]], specials: Sequence[str]) -> list[int]:
    """Ids of ``render(messages)`` with ``encode(text, parse_special)``, message text never parsed for the control
    tokens spelled ``specials`` (see the module docstring)."""
    marked = [(i, path, text) for i, path, text in _strings(messages) if any(s and s in text for s in specials)]
    if not marked:
        return encode(render(messages), True)
    masked = list(messages)
    literal = {}
    for n, (i, path, text) in enumerate(marked):
        sentinel = f"{_OPEN}{n}{_CLOSE}"
        _replace(masked, path, i, sentinel)
        literal[sentinel] = text
    rendered = render(masked)
    ids: list[int] = []
    rest = rendered
    for sentinel, text in literal.items():
        before, found, after = rest.partition(sentinel)
        if not found or sentinel in after:
            raise TokenizerError("a message carries control-token text the chat template alters or repeats; it "
                                 "cannot be kept as plain text")
        if before:
            ids += encode(before, True)
        ids += encode(text, False)
        rest = after
    if rest:
        ids += encode(rest, True)
    return ids
