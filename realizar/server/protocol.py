"""OpenAI-compatible request bodies (validated with pydantic), response builders and the error body.

Only what realizar can honour is accepted (``suffix``, and ``echo`` with ``logprobs``, are refused
with a 400). Extensions: ``top_k``, ``repetition_penalty``, ``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ServerError",
    "error_body",
]

MAX_CHOICES = 16  # n (or best_of) per prompt: each choice is a generation of its own
MAX_PROMPTS = 32  # prompts in one completions request
MAX_TOP_LOGPROBS = 20
MAX_GENERATIONS = 64  # generations one request may queue (prompts x best_of, or x n)


_DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                  408: "timeout", 409: "conflict", 413: "request_too_large", 422: "invalid_value", 429: "rate_limited",
                  499: "client_closed", 500: "internal_error", 503: "unavailable"}


class ServerError(Exception):
    """An error answered with an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        # (every error names a code: clients branch on it; a 4xx without a more specific one gets its status's)
        self.code = code if code is not None else _DEFAULT_CODES.get(status)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class GenerationRequest(BaseModel):
    # OpenAI clients send fields we do not model (user, metadata, ...): keep them, ignore them. Strict types:
    # a string where a number goes, a bool where a token id goes, "yes" for a bool are refused, not coerced.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    priority: int | None = Field(default=None, gt=-(2**31), lt=2**31)  # scheduling: lower first (vLLM's field)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must not be empty")
        elif v == "":
            raise ValueError("stop sequences must not be empty")
        return v

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def choices_per_prompt(self) -> int:
        return self.n or 1

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(GenerationRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise ServerError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of < self.choices_per_prompt():
            raise ServerError(400, f"best_of ({self.best_of}) must be >= n ({self.choices_per_prompt()})",
                              param="best_of", code="invalid_value")  # fmt: skip
        if self.best_of not in (None, self.choices_per_prompt()) and self.stream:
            raise ServerError(400, "best_of > n cannot be streamed", param="best_of", code="invalid_value")
        if self.echo and self.logprobs is not None:
            raise ServerError(400, "logprobs of the echoed prompt are not supported (echo with logprobs)",
                              param="echo", code="unsupported_parameter")  # fmt: skip

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (each text or token ids), in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if len(p) == 0:
            raise ServerError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise ServerError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", param="prompt",
                              code="invalid_value")  # fmt: skip
        out = [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[misc]
        runs = len(out) * (self.best_of or self.choices_per_prompt())
        if runs > MAX_GENERATIONS:
            raise ServerError(400, f"{len(out)} prompts x {self.best_of or self.choices_per_prompt()} choices = {runs} "
                              f"generations; at most {MAX_GENERATIONS} per request", param="n", code="invalid_value")
        return out


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise ServerError(400, f"content parts of type {part.type!r} are not supported (text only)",
                                  param="messages", code="unsupported_content")
            if part.text is None:
                raise ServerError(400, f"content part {j} of type 'text' has no text (a string is needed, got null)",
                                  param="messages", code="invalid_value")
            pieces.append(part.text)
        return "".join(pieces)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None  # checked by realizar.text.tool_calls
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # checked by realizar.structured
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0:
            raise ServerError(400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise ServerError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    def logprobs_wanted(self) -> int | None:
        """How many top alternatives each token lists (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def plain_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template: role and text, with the tool-calling fields
        (``tool_calls``, ``tool_call_id``, ``name``) of assistant and tool messages kept."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            extra = m.model_extra or {}
            if role == "assistant" and isinstance(extra.get("tool_calls"), list):
                msg["tool_calls"] = extra["tool_calls"]
            if role == "tool" and isinstance(extra.get("tool_call_id"), str):
                msg["tool_call_id"] = extra["tool_call_id"]
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


# ----------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(rid: str, created: int, model: str, obj: str, choice: dict, u: dict | None = None) -> dict:
    """The fields every OpenAI completion object and stream chunk shares, around one choice."""
    return envelope(rid, created, model, obj, [{"index": 0, **choice}], u)


def envelope(rid: str, created: int, model: str, obj: str, choices: list[dict], u: dict | None = None) -> dict:
    """The fields every OpenAI completion object and stream chunk shares, around its choices (each
    with its ``index``)."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices}  # fmt: skip
    if u is not None:
        body["usage"] = u
    return body


def completion_response(rid: str, created: int, model: str, text: str, finish: str, u: dict) -> dict:
    return _envelope(rid, created, model, "text_completion",
                     {"text": text, "logprobs": None, "finish_reason": finish}, u)


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return _envelope(rid, created, model, "text_completion", {"text": text, "logprobs": None, "finish_reason": finish})


def chat_response(rid: str, created: int, model: str, text: str, finish: str, u: dict) -> dict:
    message = {"role": "assistant", "content": text}
    return _envelope(rid, created, model, "chat.completion",
                     {"message": message, "logprobs": None, "finish_reason": finish}, u)


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return _envelope(rid, created, model, "chat.completion.chunk",
                     {"delta": delta, "logprobs": None, "finish_reason": finish})


def usage_chunk(rid: str, created: int, model: str, obj: str, u: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}
