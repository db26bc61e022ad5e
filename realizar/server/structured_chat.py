"""What ``response_format``, ``tools`` and ``tool_choice`` do to one chat request: the messages
and tools the chat template gets, the grammar constraint added to the sampling parameters, and the
assistant message built from the generated text (content, or ``tool_calls``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from realizar.errors import RealizarError
from realizar.generation import SamplingParams
from realizar.server import protocol as P
from realizar.structured import StructuredOutputError, compile_grammar, json_schema_grammar, response_format_grammar
from realizar.text import tool_calls as T

__all__ = ["ChatPlan", "plan_chat"]


@dataclass
class ChatPlan:
    tools: list[dict] = field(default_factory=list)
    choice: T.ToolChoice = T.ToolChoice("none")
    processor: Any = None  # a GrammarLogitsProcessor, or None
    system_tools: bool = False  # the template ignores tools: list them in a system message

    @property
    def parses_tools(self) -> bool:
        return self.choice.mode != "none"

    def template_tools(self) -> list[dict] | None:
        return self.tools if self.tools and self.choice.mode != "none" and not self.system_tools else None

    def messages(self, messages: list[dict]) -> list[dict]:
        msgs = T.template_messages(messages)
        if self.system_tools and self.tools and self.choice.mode != "none":
            text = T.tools_system_prompt(self.tools)
            if msgs and msgs[0].get("role") == "system":
                msgs[0] = {**msgs[0], "content": f"{msgs[0].get('content') or ''}\n\n{text}".lstrip()}
            else:
                msgs.insert(0, {"role": "system", "content": text})
        return msgs

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.processor is None:
            return params
        return dataclasses.replace(params, logits_processors=(*params.logits_processors, self.processor))

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant message for ``text`` and the finish reason (``"tool_calls"`` when the
        generation ended by itself with calls to declared tools)."""
        if self.parses_tools and finish == "stop":
            names = [t["function"]["name"] for t in self.tools]
            content, calls = T.parse_tool_calls(text, names)
            if calls:
                msg = {"role": "assistant", "content": content, "tool_calls": T.openai_tool_calls(calls)}
                return msg, "tool_calls"
        return {"role": "assistant", "content": text}, finish


def plan_chat(req: P.ChatCompletionRequest, tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> ChatPlan:
    """The plan of ``req`` (compiling its grammar, which may take a moment on the first request of
    a large vocabulary); ``eos_token_ids`` are the generator's end-of-sequence ids beyond the
    tokenizer's. Bad ``tools``, ``tool_choice`` or ``response_format`` raise a 400."""
    try:
        tools = T.check_tools(req.tools)
        choice = T.resolve_tool_choice(req.tool_choice, tools)
    except T.ToolError as e:
        raise P.ServerError(400, str(e), param=e.param, code="invalid_value") from None
    plan = ChatPlan(tools=tools, choice=choice)
    plan.system_tools = bool(tools) and not T.template_renders_tools(getattr(tokenizer, "chat_template", None))
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    schema = T.tool_call_schema(tools, choice, parallel)
    param = "tools" if schema is not None else "response_format"
    try:
        grammar = json_schema_grammar(schema) if schema is not None else response_format_grammar(req.response_format)
        if grammar is not None:
            ends = (*eos_token_ids, *(req.stop_token_ids or ()))
            plan.processor = compile_grammar(tokenizer, grammar, ends)
    except StructuredOutputError as e:
        raise P.ServerError(400, str(e), param=param, code="invalid_value") from None
    except RealizarError as e:
        raise P.ServerError(400, f"structured output is not available for this model: {e}", param=param,
                            code="unsupported_parameter") from None  # fmt: skip
    if req.response_format is not None and schema is None and plan.processor is not None:
        plan.choice = T.ToolChoice("none") if plan.choice.mode == "auto" else plan.choice
    return plan
