"""OpenAI's Responses API (``POST /v1/responses``), stateless as llama.cpp and vLLM serve it: the request
body, its translation into the chat endpoint's request (messages, ``tools``, ``tool_choice`` and
``response_format``, which :func:`realizar.server.structured_chat.plan_chat` understands), the response
object and its output items, and the stream events. Errors keep the server's (OpenAI's) error body.

Accepted: ``model``, ``input`` (a string, or a list of items: messages with the role ``user``,
``assistant``, ``system`` or ``developer`` whose content is a string or ``input_text``/``output_text``
parts, ``function_call`` and ``function_call_output`` items), ``instructions``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``tools`` (``function`` tools), ``tool_choice``, ``text.format``
(``text``, ``json_schema``, ``json_object``), ``parallel_tool_calls``; ``metadata``, ``user``, ``store``
and a few hints (:data:`_IGNORED`) are taken and ignored (nothing is stored); ``top_k`` and ``seed`` are
extensions. Anything else (``previous_response_id``, images, files, reasoning items, built-in tools such
as ``web_search``) is a 400 naming what came and what is accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from realizar.server import protocol as P
from realizar.server.anthropic import kind_name, new_id

__all__ = ["ResponsesRequest", "output_items", "response_object"]

_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
           "tool_choice", "text", "parallel_tool_calls", "metadata", "user", "store")
# taken and ignored: hints with nothing to do here (no storage, no tiers, the prefix cache needs no key)
_IGNORED = {"metadata", "user", "store", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options"}
# taken when they ask for nothing: {field: the values that do}
_NEUTRAL = {"truncation": (None, "disabled"), "include": (None, []), "background": (None, False),
            "reasoning": (None, {}), "max_tool_calls": (None,)}
_STATELESS = ("previous_response_id", "conversation")
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}


def _bad(message: str, param: str = "input") -> P.ServerError:
    return P.ServerError(400, message, param=param, code="invalid_value")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stream: bool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def chat_request(self) -> P.ChatCompletionRequest:
        """The equivalent chat completions request (400 for what has no equivalent here)."""
        extra = self.model_extra or {}
        for name in _STATELESS:
            if extra.get(name) is not None:
                raise _bad(f"{name} is not supported: this server is stateless and stores no responses or "
                           "conversations; send the whole conversation in 'input'", name)
        for name, ok in _NEUTRAL.items():
            if name in extra and extra[name] not in ok:
                raise _bad(f"{name} {extra[name]!r} is not supported (only {' or '.join(map(repr, ok))})", name)
        unknown = sorted(set(extra) - _IGNORED - set(_NEUTRAL) - set(_STATELESS))
        if unknown:
            raise _bad(f"unsupported field(s) {', '.join(unknown)}: this server accepts {', '.join(_FIELDS)}",
                       unknown[0])
        tools = _tools(self.tools)
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": bool(self.stream)}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if tools:
            body["tools"] = tools
        choice = _tool_choice(self.tool_choice, bool(tools))
        if choice is not None:
            body["tool_choice"] = choice
        fmt = response_format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        return P.ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict]:
        out: list[dict] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise _bad("input must be a non-empty string or list of items")
        calls: dict[str, str] = {}  # call_id -> name, of every function_call so far
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = _item_type(item, where)
            if kind == "message":
                out.append(_message(item, where))
            elif kind == "function_call":
                call = _function_call(item, where)
                calls[call["id"]] = call["function"]["name"]
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # (text, then calls: one assistant turn)
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append(_function_output(item, where, calls))
        return out


def _item_type(item: Any, where: str) -> str:
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an input item (an object), got {kind_name(item)}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in _ITEM_KEYS:
        got = "an object without a type or role" if kind is None else f"an item of type {kind!r}"
        raise _bad(f"{where}: got {got}; this server accepts items of type {', '.join(map(repr, _ITEM_KEYS))} "
                   "(reasoning, item references, images, files and built-in tool calls are not supported)")
    unknown = sorted(set(item) - _ITEM_KEYS[kind])
    if unknown:
        raise _bad(f"{where}: a {kind!r} item takes {', '.join(sorted(_ITEM_KEYS[kind]))}, got also "
                   f"{', '.join(unknown)}")
    return kind


def _message(item: dict, where: str) -> dict:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise _bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    else:
        raise _bad(f"{where}.content must be a string or a list of content parts, got {kind_name(content)}")
    return {"role": "system" if role == "developer" else role, "content": text}


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text"):
        got = f"a part of type {kind!r}" if isinstance(kind, str) else kind_name(part)
        raise _bad(f"{where}: got {got}; this server accepts text only (parts of type 'input_text' or "
                   "'output_text'; images, files and audio are not supported)")
    unknown = sorted(set(part) - _PART_KEYS)
    if unknown:
        raise _bad(f"{where}: a {kind!r} part takes type and text, got also {', '.join(unknown)}")
    if not isinstance(part.get("text"), str):
        raise _bad(f"{where}.text must be a string, got {kind_name(part.get('text'))}")
    return part["text"]


def _function_call(item: dict, where: str) -> dict:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(cid, str) or not cid or not isinstance(name, str) or not isinstance(args, str):
        raise _bad(f"{where}: a function_call item needs call_id, name and arguments (a JSON string), got "
                   f"{kind_name(cid)}, {kind_name(name)} and {kind_name(args)}")
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _function_output(item: dict, where: str, calls: dict[str, str]) -> dict:
    cid, output = item.get("call_id"), item.get("output")
    if cid not in calls:
        raise _bad(f"{where}: function_call_output names call_id {cid!r}, but no earlier function_call item has "
                   f"that call_id (known: {sorted(calls) or 'none'})")
    if isinstance(output, list):
        output = "".join(_part_text(p, f"{where}.output[{j}]") for j, p in enumerate(output))
    elif not isinstance(output, str):
        raise _bad(f"{where}.output must be a string or a list of text parts, got {kind_name(output)}")
    return {"role": "tool", "tool_call_id": cid, "name": calls[cid], "content": output}


def _tools(tools: list | None) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else kind_name(t)
        if kind != "function":
            raise _bad(f"tools[{i}]: only function tools (type 'function') are supported, got {kind!r} "
                       "(built-in tools such as web_search, file_search or code_interpreter are not)", "tools")
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise _bad(f"tools[{i}] takes name, description, parameters and strict, got also {', '.join(unknown)}",
                       "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, has_tools: bool) -> Any:
    """The chat request's ``tool_choice`` of the Responses API's."""
    if choice is None or choice in ("auto", "none"):
        return choice
    if not has_tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, got "
               f"{choice!r}", "tool_choice")


def response_format(text: dict | None) -> dict | None:
    """The chat request's ``response_format`` of ``text.format``."""
    if not text:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _bad(f"text takes format, got also {', '.join(unknown)}", "text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad(f"text.format.schema must be a JSON schema object, got {kind_name(fmt.get('schema'))}", "text")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {kind!r}", "text")


# ----------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------


def output_items(message: dict, incomplete: bool) -> list[dict]:
    """The output items of an (OpenAI-style) assistant message: a ``message`` item with its text, then a
    ``function_call`` item per tool call."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": new_id("msg"), "status": "incomplete" if incomplete else "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for c in calls:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def response_object(rid: str, created: float, model: str, body: ResponsesRequest, output: list[dict],
                    status: str, n_in: int, n_out: int) -> dict:  # fmt: skip
    """The ``response`` object (its settings echoed from the request)."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in body.tools or []]
    extra = body.model_extra or {}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": fmt}, "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": tools, "truncation": "disabled", "user": extra.get("user"), "metadata": extra.get("metadata") or {},
        "usage": None if status == "in_progress" else {
            "input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out},
    }  # fmt: skip

