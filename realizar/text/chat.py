"""Chat templates: render a conversation with a model's jinja2 template the way transformers'
``apply_chat_template(..., tokenize=False)`` does.

The environment matches transformers': a sandboxed (immutable) jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does
not escape HTML or non-ASCII, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore-prefixed names. ``{% generation %}`` blocks (used by
templates that mark assistant tokens) render their body unchanged.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from realizar.errors import TokenizerError

__all__ = ["render_chat", "CHATML_TEMPLATE", "ChatTemplateError"]

#: The plain ChatML layout, used only when a caller asks for it (``fallback_chatml=True``).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(TokenizerError):
    """The chat template is missing, does not compile, or failed while rendering."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:  # pragma: no cover - jinja2 is a hard dependency
        raise ChatTemplateError(f"rendering chat templates needs jinja2: {e}") from e
    return jinja2


def _raise_exception(message: Any) -> None:
    raise _jinja().exceptions.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictMaker:
    """``dict(...)`` inside templates without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile(template: str):
    jinja2 = _jinja()

    class _Namespace(jinja2.utils.Namespace):
        # no dunder/underscore attributes: they lead to interpreter internals
        def __init__(*args: Any, **kwargs: Any):  # same signature trick as jinja2's Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types, so that the sandbox only ever sees str,
    int, float, bool, None, dict, list and tuple (rich objects become an inert ``"<TypeName>"``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    dump = getattr(value, "model_dump", None)  # pydantic models
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    fallback_chatml: bool = False,
    **kwargs: Any,
) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the jinja2 chat
    ``template``; the result equals transformers' ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)`` for a tokenizer whose special tokens are ``bos_token``/``eos_token``
    (pass ``pad_token``, ``unk_token`` or template variables such as ``enable_thinking`` as keywords).

    With no template a :class:`ChatTemplateError` (a :class:`~realizar.errors.TokenizerError`) is
    raised, unless ``fallback_chatml=True`` asks for the plain ChatML layout. Errors raised by the
    template (``raise_exception(...)``), syntax errors and sandbox violations become
    :class:`ChatTemplateError` too.
    """
    if template is None or (isinstance(template, str) and not template.strip()):
        if not fallback_chatml:
            raise ChatTemplateError(
                "this model has no chat template; pass a template, or fallback_chatml=True for plain ChatML"
            )
        template = CHATML_TEMPLATE
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template is a str, got {type(template).__name__}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    chat = _plain(list(messages))
    for i, m in enumerate(chat):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} is a {type(m).__name__}, not a dict")
        if "role" not in m:
            raise ChatTemplateError(f"message {i} has no 'role'")
        # a message's reasoning may come as reasoning_content, thinking or reasoning; templates
        # read reasoning_content (most) or thinking (gpt-oss), so fill both, as transformers does
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            chat[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}

    jinja2 = _jinja()
    try:
        compiled = _compile(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
    context = _plain(dict(kwargs))
    context.update(bos_token=bos_token, eos_token=eos_token)
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=bool(add_generation_prompt),
            **context,
        )
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried something the sandbox forbids: {e}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
