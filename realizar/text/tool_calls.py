"""Tool (function) calling for chat: checking OpenAI ``tools`` / ``tool_choice``, the JSON schema
that forces a call, the prompt text for templates that do not render tools, and parsing calls out
of generated text.

Formats understood in generated text:

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
  call, text around the blocks is the message content; an unclosed last block counts);
* Llama 3.x: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``);
* Mistral: ``[TOOL_CALLS]`` followed by a JSON list of calls;
* a bare JSON object or list of ``{"name", "arguments"}`` (what forced tool choice generates).

A call counts only if it names a declared tool and its arguments are a JSON object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from realizar.errors import InvalidRequestError

__all__ = [
    "ToolCall",
    "ToolChoice",
    "check_tools",
    "resolve_tool_choice",
    "tool_call_schema",
    "tools_system_prompt",
    "template_renders_tools",
    "parse_tool_calls",
    "openai_tool_calls",
    "template_messages",
]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
MAX_TOOLS = 128


class ToolError(InvalidRequestError):
    """Malformed ``tools`` or ``tool_choice``; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def check_tools(tools: Any) -> list[dict]:
    """The request's tools as ``[{"type": "function", "function": {"name", "description"?,
    "parameters"}}]`` (``parameters`` defaults to an object with no properties); raises
    :class:`ToolError` naming what is wrong."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a list, got {type(tools).__name__}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolError(f"tools[{i}].function must be an object with a 'name'", "tools")
        name = fn.get("name")
        if not (isinstance(name, str) and _NAME.match(name)):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}", "tools")
        if name in seen:
            raise ToolError(f"tools[{i}]: the function name {name!r} is declared twice", "tools")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        entry = {"name": name, **({"description": desc} if desc is not None else {}), "parameters": dict(params)}
        out.append({"type": "function", "function": entry})
    return out


def resolve_tool_choice(choice: Any, tools: Sequence[Mapping]) -> ToolChoice:
    """``tool_choice`` of a request with the (checked) ``tools``: ``"none"``, ``"auto"`` (the
    default with tools), ``"required"``, or ``{"type": "function", "function": {"name": ...}}``."""
    names = {t["function"]["name"] for t in tools}
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise ToolError(f"tool_choice's function name must be a string naming one of the tools {sorted(names)}, "
                            f"got {name!r}", "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools {sorted(names)}", "tool_choice")
        return ToolChoice("function", name)
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _call_schema(tool: Mapping) -> dict:
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(tools: Sequence[Mapping], choice: ToolChoice, parallel: bool = True) -> dict | None:
    """The JSON schema forced tool choice generates: one ``{"name", "arguments"}`` object for a
    named function, a non-empty list of calls to any tool for ``"required"``; ``None`` otherwise."""
    if choice.mode == "function":
        return _call_schema(next(t for t in tools if t["function"]["name"] == choice.name))
    if choice.mode == "required":
        items = {"anyOf": [_call_schema(t) for t in tools]}
        schema: dict = {"type": "array", "items": items, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return schema
    return None


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (else tools go into a system message)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_system_prompt(tools: Sequence[Mapping]) -> str:
    """Instructions listing the tools, for models whose chat template does not render them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to answer. The functions are described by these JSON "
        "signatures:\n<tools>\n" + listing + "\n</tools>\n"
        "To call a function, answer with a JSON object in tags, one per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    )


def _as_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, Mapping):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if name not in names or not isinstance(args, Mapping):
        return None
    return ToolCall(name, dict(args))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` consists of (separated by blanks or ``;``), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _calls_from_values(values: list[Any], names: set[str]) -> list[ToolCall] | None:
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_as_call(v, names) for v in flat]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """Split generated ``text`` into (content, calls). Text that holds no well-formed call to a
    declared tool comes back whole as content with no calls."""
    names = set(tool_names)
    if "<tool_call>" in text:
        calls = []
        for body in _HERMES.findall(text):
            values = _json_values(body.strip())
            found = _calls_from_values(values, names) if values else None
            if found is None:
                return text, []
            calls.extend(found)
        content = _HERMES.sub("", text).strip()
        return (content or None), calls
    stripped = text.strip()
    for prefix in ("[TOOL_CALLS]", "<|python_tag|>"):
        if stripped.startswith(prefix):
            stripped = stripped[len(prefix) :].strip()
    if stripped[:1] in ("{", "["):
        values = _json_values(stripped)
        calls = _calls_from_values(values, names) if values else None
        if calls:
            return None, calls
    return text, []


def openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict]:
    """``message.tool_calls`` of an OpenAI chat completion (``arguments`` as a JSON string)."""
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """OpenAI messages as chat templates expect them: an assistant's ``tool_calls`` arguments as
    objects (templates apply ``tojson`` to them), other fields unchanged."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                c = dict(c) if isinstance(c, Mapping) else c
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    try:
                        c["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
                    except ValueError:
                        pass
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out
