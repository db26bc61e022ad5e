"""Anthropic's Messages API (``POST /v1/messages``): the request body, its translation into the chat
endpoint's request (OpenAI messages, ``tools`` and ``tool_choice``, which
:func:`realizar.server.structured_chat.plan_chat` understands), the response and stream events, and the
error body ``{"type": "error", "error": {"type", "message"}}`` that every answer under ``/v1/messages``
gets (:class:`AnthropicErrorMiddleware` rewrites the server's OpenAI-style errors there).

Accepted: ``model``, ``max_tokens``, ``messages`` (``user``/``assistant``; content a string or ``text``,
``tool_use`` and ``tool_result`` blocks), ``system``, ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, ``stream``, ``tools`` (client tools with an ``input_schema``), ``tool_choice`` and ``metadata``
(ignored); ``cache_control`` on blocks and tools is ignored. Anything else (images, documents,
``thinking``, server tools, a final assistant message to continue) is a 400 naming what was expected.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from realizar.server import protocol as P

__all__ = ["AnthropicErrorMiddleware", "MessagesRequest", "error_body", "is_messages_path", "new_id"]

MAX_STOP_SEQUENCES = 16
_FIELDS = ("model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
           "tools", "tool_choice", "metadata")
_IGNORED = {"cache_control"}  # (prompt caching hints: the prefix cache needs none)

# the server's HTTP status -> Anthropic's error type (and the status Anthropic answers with)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                499: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str, code: str | None = None) -> tuple[int, dict]:
    """Anthropic's status and error body for a server error of ``status`` (a full queue is Anthropic's
    529 ``overloaded_error``)."""
    if status == 429 and code == "queue_full":
        status = 529
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def _bad(message: str, param: str = "messages") -> P.ServerError:
    return P.ServerError(400, message, param=param, code="invalid_value")


def kind_name(x: Any) -> str:
    return "null" if x is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(x), type(x).__name__)


# content blocks are taken as plain objects and checked here (:func:`_fields`), for messages that name
# what was expected and what came
Block = dict[str, Any]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Any  # a string or a list of blocks, checked by _user / _assistant


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: Any = None  # a string or a list of text blocks
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def chat_request(self) -> P.ChatCompletionRequest:
        """The equivalent chat completions request (400 for what has no equivalent here)."""
        extra = sorted(set(self.model_extra or {}) - _IGNORED)
        if extra:
            raise _bad(f"unsupported field(s) {', '.join(extra)}: this server accepts {', '.join(_FIELDS)}", extra[0])
        stops = list(self.stop_sequences or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(s == "" for s in stops):
            raise _bad(f"stop_sequences must be at most {MAX_STOP_SEQUENCES} non-empty strings, got {stops!r}",
                       "stop_sequences")
        tools = _tools(self.tools)
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": self._messages(),
                                "stream": bool(self.stream)}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if tools:
            body["tools"] = tools
            body["tool_choice"], parallel = _tool_choice(self.tool_choice, [t["function"]["name"] for t in tools])
            body["parallel_tool_calls"] = parallel
        elif self.tool_choice is not None and self.tool_choice.get("type") not in ("auto", "none"):
            raise _bad(f"tool_choice {self.tool_choice.get('type')!r} needs tools", "tool_choice")
        req = P.ChatCompletionRequest.model_validate(body)
        req.stop = stops or None  # (past the chat request's limit of 4: Anthropic allows more)
        return req

    def _messages(self) -> list[dict]:
        out: list[dict] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "\n".join(
                _text(b, f"system[{i}]") for i, b in enumerate(_listed(self.system, "system", "text blocks")))
            if text:
                out.append({"role": "system", "content": text})
        open_calls: dict[str, str] = {}  # tool_use id -> name, of the last assistant message
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.model_extra:
                raise _bad(f"{where}: unsupported field(s) {', '.join(sorted(m.model_extra))} (role and content only)")
            if m.role == "user":
                out.extend(_user(m.content, where, open_calls))
                open_calls = {}
            elif m.role == "assistant":
                msg, open_calls = _assistant(m.content, where)
                out.append(msg)
            else:
                hint = " (a system prompt goes in the top-level 'system' field)" if m.role == "system" else ""
                raise _bad(f"{where}.role must be 'user' or 'assistant', got {m.role!r}{hint}")
        if self.messages[0].role != "user":
            raise _bad(f"the first message must have the role 'user', got {self.messages[0].role!r}")
        if self.messages[-1].role != "user":
            raise _bad("the last message must have the role 'user' (continuing a final assistant message is not "
                       f"supported), got {self.messages[-1].role!r}")
        return out


def _type(b: Any, where: str) -> str:
    kind = b.get("type") if isinstance(b, dict) else None
    if not isinstance(kind, str):
        got = "an object without a type" if isinstance(b, dict) else kind_name(b)
        raise _bad(f"{where}: expected a content block (an object with a 'type'), got {got}")
    return kind


def _fields(b: Block, where: str, allowed: tuple[str, ...]) -> dict:
    kind = _type(b, where)
    extra = {k: v for k, v in b.items() if k not in _IGNORED and k != "type"}
    if kind == "text" and extra.get("citations") in (None, []):
        extra.pop("citations", None)
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise _bad(f"{where}: a {kind!r} block takes {', '.join(allowed)}, got also {', '.join(unknown)}")
    return extra


def _text(b: Block, where: str) -> str:
    if _type(b, where) != "text":
        raise _bad(f"{where}: expected a 'text' block, got a {b['type']!r} block")
    text = _fields(b, where, ("text",)).get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text must be a string, got {kind_name(text)}")
    return text


def _listed(content: Any, where: str, what: str = "content blocks") -> list:
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of {what}, got {kind_name(content)}", where.split("[")[0])
    return content


def _user(content: str | list[Block], where: str, open_calls: dict[str, str]) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    for at, kind, b in _blocks(content, where):
        if kind == "text":
            texts.append(_text(b, at))
        elif kind == "tool_result":
            f = _fields(b, at, ("tool_use_id", "content", "is_error"))
            tid = f.get("tool_use_id")
            if tid not in open_calls:
                known = sorted(open_calls) or "none"
                raise _bad(f"{at}: tool_result names tool_use_id {tid!r}, but the previous assistant message has no "
                           f"tool_use block with that id (its ids: {known})")
            result = f.get("content", "")
            if isinstance(result, list):
                result = "".join(_text(x, f"{at}.content[{k}]") for k, x in enumerate(result))
            elif not isinstance(result, str):
                raise _bad(f"{at}.content must be a string or a list of text blocks, got {kind_name(result)}")
            if f.get("is_error") is True:
                result = "Error: " + result
            if texts:  # (text before a tool result: its own user turn)
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": tid, "name": open_calls[tid], "content": result})
        else:
            raise _bad(f"{at}: a user message's blocks must be 'text' or 'tool_result', got {kind!r}")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _blocks(content: list, where: str) -> Iterator[tuple[str, str, Any]]:
    """(where, type, block) of each block of a message's ``content`` list."""
    _listed(content, f"{where}.content")
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        yield at, _type(b, at), b


def _assistant(content: str | list[Block], where: str) -> tuple[dict, dict[str, str]]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, {}
    texts, calls, ids = [], [], {}
    for at, kind, b in _blocks(content, where):
        if kind == "text":
            texts.append(_text(b, at))
        elif kind == "tool_use":
            f = _fields(b, at, ("id", "name", "input"))
            tid, name, args = f.get("id"), f.get("name"), f.get("input")
            if not isinstance(tid, str) or not tid or not isinstance(name, str) or not isinstance(args, dict):
                raise _bad(f"{at}: a tool_use block needs id (string), name (string) and input (object), got "
                           f"{kind_name(tid)}, {kind_name(name)} and {kind_name(args)}")
            ids[tid] = name
            calls.append({"id": tid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise _bad(f"{at}: an assistant message's blocks must be 'text' or 'tool_use', got {kind!r}")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg, ids


def _tools(tools: list[dict] | None) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        kind = t.get("type", "custom")
        if kind != "custom":
            raise _bad(f"tools[{i}]: only client tools (type 'custom', with an input_schema) are supported, got type "
                       f"{kind!r}", "tools")
        unknown = sorted(set(t) - {"type", "name", "description", "input_schema"} - _IGNORED)
        if unknown:
            raise _bad(f"tools[{i}] takes name, description and input_schema, got also {', '.join(unknown)}", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools[{i}].input_schema must be a JSON schema object, got {kind_name(t.get('input_schema'))}",
                       "tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None, names: list[str]) -> tuple[Any, bool]:
    """The OpenAI ``tool_choice`` and ``parallel_tool_calls`` of Anthropic's ``tool_choice``."""
    choice = choice or {"type": "auto"}
    kind = choice.get("type")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise _bad(f"tool_choice takes type, name and disable_parallel_tool_use, got also {', '.join(unknown)}",
                   "tool_choice")
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise _bad(f"tool_choice names the tool {name!r}, which is not among the tools {names}", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _bad(f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice")


# ----------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------


def content_blocks(message: dict) -> list[dict]:
    """The content blocks of an (OpenAI-style) assistant message: its text, then its tool calls."""
    blocks = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for c in calls:
        blocks.append({"type": "tool_use", "id": new_id("toolu"), "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])})
    return blocks


def stop_reason(finish: str, stops: tuple[str, ...], decode: Any, token_ids: list[int]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished generation: ``"tool_use"`` for tool calls,
    ``"max_tokens"`` at the limit, ``"stop_sequence"`` when one of ``stops`` ended it (found in the
    decoded tokens, the one completed first as the generator's matcher picks it), else ``"end_turn"``."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stops:
        full = decode(token_ids)
        best = None
        for s in stops:
            i = full.find(s)  # (the text sent holds none: the generation would have stopped there)
            if i >= 0 and (best is None or (i + len(s), i) < best[0]):
                best = ((i + len(s), i), s)
        if best is not None:
            return "stop_sequence", best[1]
    return "end_turn", None


def message(rid: str, model: str, content: list[dict], reason: str | None, seq: str | None, n_in: int,
            n_out: int) -> dict:  # fmt: skip
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": n_in, "output_tokens": n_out}}  # fmt: skip


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: " + json.dumps({"type": event, **data}, ensure_ascii=False,
                                                  separators=(",", ":")) + "\n\n"


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


class AnthropicErrorMiddleware:
    """Under ``/v1/messages``, an error answered in OpenAI's shape (``{"error": {"message", ...}}``, by a
    route, the error handlers, the API key or the body limit) is answered in Anthropic's instead. Pure
    ASGI: streams and other paths pass through untouched."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}

        async def send_wrapper(msg: dict) -> None:
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                held["start"], held["body"] = msg, b""
                return
            if msg["type"] == "http.response.body" and "start" in held:
                held["body"] += msg.get("body", b"")
                if msg.get("more_body"):
                    return
                await _send_rewritten(send, held.pop("start"), held.pop("body"))
                return
            await send(msg)

        await self.app(scope, receive, send_wrapper)


async def _send_rewritten(send: Any, start: dict, body: bytes) -> None:
    status, headers = start["status"], [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
    try:
        err = json.loads(body)["error"]
        status, new = error_body(status, str(err["message"]), err.get("code"))
        body = json.dumps(new, ensure_ascii=False).encode("utf-8")
    except (ValueError, KeyError, TypeError):
        pass  # (not an OpenAI error body: sent as it was)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
