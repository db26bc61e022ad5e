"""Structured output: JSON (any object, or one that follows a JSON schema) through
grammar-constrained sampling.

A schema is compiled by **llguidance** into a grammar over bytes, and a matcher walks that grammar
token by token over the model's own vocabulary, giving at each step the set of tokens that keep the
output a valid prefix. :class:`GrammarLogitsProcessor` plugs that mask into
``SamplingParams.logits_processors``: disallowed tokens get ``-inf``, end-of-sequence is allowed
only once the grammar accepts (and is the only choice once the grammar is complete), so a
generation that ends by EOS always parses and validates. A generation cut by ``max_tokens`` ends
with ``finish_reason == "length"`` and may be truncated JSON, as with OpenAI.

Why llguidance (over xgrammar and outlines-core): its wheel is a single abi3 build for every
CPython >= 3.10 with no Python dependencies (xgrammar requires torch, transformers and triton);
it reads a ``tokenizers`` tokenizer's JSON directly, which is what realizar's tokenizer wraps; the
mask is computed lazily per step (no up-front index over the whole vocabulary, which outlines-core
builds per schema and which grows with vocabulary and schema size); it covers much of JSON
Schema (refs, anyOf/oneOf, enums, string and number bounds, patterns) and reports unsupported
keywords instead of ignoring them; its parser work per step is bounded by resource limits; and it
is maintained and used by several inference servers.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from realizar.errors import InvalidRequestError, UnsupportedError

__all__ = [
    "GrammarLogitsProcessor",
    "StructuredOutputError",
    "json_object_grammar",
    "json_schema_grammar",
    "compile_grammar",
    "response_format_grammar",
]

#: Largest schema accepted, as JSON text (a bound on the work a request can ask for).
MAX_SCHEMA_BYTES = 64 * 1024

# Compact JSON with the separators json.dumps writes; no free whitespace, so that a weak model
# cannot spin on blanks between tokens forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(InvalidRequestError):
    """A response format or JSON schema that cannot be compiled into a grammar."""


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise UnsupportedError(f"structured output needs the llguidance package: {e}") from e
    return llguidance


def json_schema_grammar(schema: Any, *, strict: bool = True) -> str:
    """The llguidance grammar of JSON documents that validate against ``schema`` (a dict, or
    ``True`` for any JSON value). With ``strict=False`` keywords llguidance does not implement are
    ignored; with ``strict=True`` they are an error."""
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise StructuredOutputError(f"the JSON schema is not serialisable: {e}") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise StructuredOutputError(f"the JSON schema is {len(text.encode())} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    options = dict(_JSON_OPTIONS, lenient=not strict)
    try:
        return _llg().LLMatcher.grammar_from_json_schema(text, overrides=options)
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"invalid JSON schema: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def response_format_grammar(response_format: Mapping[str, Any] | None) -> str | None:
    """The grammar an OpenAI ``response_format`` asks for: ``None`` for ``text`` (or no format),
    a grammar for ``json_object`` and ``json_schema``. Malformed formats raise
    :class:`StructuredOutputError` naming what was expected."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise StructuredOutputError(f"response_format is an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise StructuredOutputError(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise StructuredOutputError("response_format of type 'json_schema' needs a 'json_schema' object")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
        raise StructuredOutputError("json_schema.name must be a string of 1 to 64 characters")
    if "schema" not in spec:
        raise StructuredOutputError("json_schema needs a 'schema' (the JSON schema the output follows)")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputError(f"json_schema.strict must be a boolean, got {strict!r}")
    return json_schema_grammar(spec["schema"], strict=bool(strict))


# ----------------------------------------------------------------------------------------------
# the model's vocabulary, as llguidance sees it
# ----------------------------------------------------------------------------------------------

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer of a realizar :class:`~realizar.text.tokenizer.Tokenizer`, built
    once per tokenizer from its ``tokenizers`` JSON (ids the library does not know, such as
    repeated spellings of a GGUF vocabulary, are never allowed)."""
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(tokenizer)
        if found is None:
            eos = list(tokenizer.eos_token_ids) or None
            make = functools.partial(_llg().LLTokenizer, tokenizer.backend.to_str(), n_vocab=int(tokenizer.vocab_size))
            try:
                try:
                    found = make(eos_token=eos)
                except TypeError:  # (llguidance 1.6 takes one EOS id; the grammar's processor allows them all)
                    found = make(eos_token=eos[0] if eos else None)
            except Exception as e:  # the library's own error type
                raise UnsupportedError(f"structured output cannot use this model's tokenizer: {e}") from e
            _TOKENIZERS[tokenizer] = found
        return found


def compile_grammar(tokenizer: Any, grammar: str, eos_token_ids: Sequence[int] = ()) -> "GrammarLogitsProcessor":
    """Check ``grammar`` against ``tokenizer``'s vocabulary; raises :class:`StructuredOutputError`
    with llguidance's message when it does not compile. Returns a fresh processor for one request;
    the ids that end its generation are the tokenizer's EOS ids and ``eos_token_ids``."""
    llg = _llg()
    ll_tok = _ll_tokenizer(tokenizer)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
    if is_error:
        raise StructuredOutputError(f"invalid JSON schema: {_engine_message(messages[0] if messages else '')}")
    processor = GrammarLogitsProcessor(ll_tok, grammar, (*tokenizer.eos_token_ids, *eos_token_ids))
    # fail closed, before the response starts: the first mask is where a grammar that compiled may still fail
    # (a schema that refers only to itself), or allow nothing at all
    first = processor.allowed([], strict=True)
    if not first.any():
        raise StructuredOutputError("the JSON schema cannot be enforced: no output satisfies it")
    return processor


_PROCESS_TOKENIZER: list = []  # the tokenizer of this process's engine (use_process_tokenizer)


def use_process_tokenizer(tokenizer: Any) -> None:
    """Make ``tokenizer`` the one a processor sent to this process is rebuilt against (the engine process)."""
    _PROCESS_TOKENIZER[:] = [tokenizer]


def _rebuild_processor(grammar: str, eos_token_ids: tuple) -> "GrammarLogitsProcessor":
    if not _PROCESS_TOKENIZER:
        raise StructuredOutputError("a grammar processor was unpickled in a process without a tokenizer")
    return GrammarLogitsProcessor(_ll_tokenizer(_PROCESS_TOKENIZER[0]), grammar, eos_token_ids)


def _engine_message(text: str) -> str:
    """llguidance's message without the matcher state it may append: its first line, at most 200 characters."""
    lines = text.split("<state>", 1)[0].strip().splitlines()
    return (lines[0].strip() if lines else "")[:200] or "the grammar does not compile"


class GrammarLogitsProcessor:
    """A ``SamplingParams.logits_processors`` entry that keeps the output inside a grammar.

    Called as ``fn(generated_ids, logits)``: the ids generated so far are fed to the matcher (the
    processor follows whatever sequence it is shown, rolling back where a new one diverges, so one
    instance may serve several generations in turn), then every token the grammar does not allow
    next gets ``-inf``. ``eos_token_ids`` (the ids that end a generation) are allowed exactly when
    the grammar accepts; once the grammar can take nothing more they are the only choice.
    """

    def __init__(self, ll_tokenizer: Any, grammar: str, eos_token_ids: Sequence[int]):
        llg = _llg()
        self._grammar, self._eos_ids = grammar, tuple(int(t) for t in eos_token_ids)
        self._matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise StructuredOutputError(f"invalid grammar: {_engine_message(self._matcher.get_error())}")
        self._n_vocab = int(ll_tokenizer.vocab_size)
        self._eos = np.array(sorted({int(t) for t in eos_token_ids}), dtype=np.int64)
        self._consumed: list[int] = []
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:
        # (sent to the engine process as its grammar: rebuilt there against that process's tokenizer)
        return _rebuild_processor, (self._grammar, self._eos_ids)

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    def _follow(self, generated: Sequence[int]) -> None:
        common = 0
        limit = min(len(self._consumed), len(generated))
        while common < limit and self._consumed[common] == generated[common]:
            common += 1
        if common < len(self._consumed):
            back = len(self._consumed) - common
            if not self._matcher.rollback(back):
                self._matcher.reset()
                common = 0
            del self._consumed[common:]
        for t in generated[common:]:
            t = int(t)
            if not self._matcher.consume_token(t):
                raise StructuredOutputError(f"token {t} does not fit the grammar: "
                                            f"{_engine_message(self._matcher.get_error())}")
            self._consumed.append(t)

    def allowed(self, generated: Sequence[int], strict: bool = False) -> np.ndarray:
        """Boolean mask over the vocabulary: the tokens that may come after ``generated``. With ``strict``, a
        matcher that fails computing it raises :class:`StructuredOutputError` (else only the end is allowed)."""
        with self._lock:
            self._follow(generated)
            m = self._matcher
            if m.is_stopped():
                allowed = np.zeros(self._n_vocab, dtype=bool)
            else:
                bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
                allowed = np.unpackbits(bits, bitorder="little")[: self._n_vocab].astype(bool)
                if m.is_error():
                    if strict:
                        raise StructuredOutputError(f"the JSON schema cannot be enforced: no output can begin it "
                                                    f"({_engine_message(m.get_error())})")
                    allowed[:] = False
            eos = self._eos[self._eos < self._n_vocab]
            allowed[eos] = bool(m.is_accepting()) or bool(m.is_stopped())
            if not allowed.any():  # nothing fits (the matcher failed): end rather than emit junk
                allowed[eos] = True
            return allowed

    def __call__(self, generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        allowed = self.allowed(generated)
        out = np.array(logits, dtype=np.float32, copy=True)
        n = min(out.shape[-1], allowed.shape[0])
        out[:n][~allowed[:n]] = -np.inf
        out[n:] = -np.inf  # padding rows of the output layer past the tokenizer's vocabulary
        return out
