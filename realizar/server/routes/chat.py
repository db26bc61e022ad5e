"""``POST /v1/chat/completions``: messages rendered with the model's chat template, answered whole
or streamed; ``response_format`` and forced ``tool_choice`` constrain the sampling to a JSON
grammar, and with ``tools`` the answer is parsed into ``tool_calls`` (see
:mod:`realizar.server.structured_chat`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from realizar.errors import RealizarError
from realizar.server import protocol as P
from realizar.server.state import ServerState, get_state
from realizar.server.structured_chat import plan_chat

router = APIRouter()


def _chat_prompt(engine: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    extra = {"tools": tools} if tools else {}
    render = getattr(engine, "chat_prompt", None)
    if callable(render):
        return list(render(messages, **extra))
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra))


@router.post("/v1/chat/completions")
async def chat_completions(req: P.ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)) -> Any:
    req.refuse_unsupported()
    state.check_model(req.model)
    eos = getattr(getattr(state.engine, "generator", None), "eos_token_ids", ())
    plan = await asyncio.to_thread(plan_chat, req, state.engine.tokenizer, eos)
    messages = plan.messages(req.plain_messages())
    try:
        ids = await asyncio.to_thread(_chat_prompt, state.engine, messages, plan.template_tools())
    except RealizarError as e:
        raise P.ServerError(400, f"cannot apply the chat template: {e}", param="messages",
                            code="invalid_value") from None  # fmt: skip
    ids = state.check_ids(list(ids))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = plan.constrain(state.sampling(req, len(ids), req.requested_max_tokens(), state.default_max_tokens, param))
    rid, ts, name = P.new_id("chatcmpl"), P.now(), state.name
    job = state.start(ids, params)

    if not req.stream:
        text, result = await state.collect(job, request)
        body = P.chat_response(rid, ts, name, text, result.finish_reason,
                               P.usage(result.prompt_tokens, result.completion_tokens))  # fmt: skip
        if plan.parses_tools:
            message, finish = plan.message(text, result.finish_reason)
            body["choices"][0].update(message=message, finish_reason=finish)
        return body

    include_usage = req.include_usage()
    held: list[str] = []  # with tools, the text is held back until it is known to be calls or not

    def render(kind: str, payload: Any) -> list[dict]:
        if kind == "start":
            return [P.chat_chunk(rid, ts, name, {"role": "assistant", "content": ""}, None)]
        if kind == "token":
            if plan.parses_tools:
                held.append(payload.text)
                return []
            return [P.chat_chunk(rid, ts, name, {"content": payload.text}, None)] if payload.text else []
        finish, out = payload.finish_reason, []
        if plan.parses_tools:
            message, finish = plan.message("".join(held), finish)
            delta = {"content": message["content"]} if message.get("content") else {}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            if delta:
                out.append(P.chat_chunk(rid, ts, name, delta, None))
        out.append(P.chat_chunk(rid, ts, name, {}, finish))
        if include_usage:
            out.append(P.usage_chunk(rid, ts, name, "chat.completion.chunk",
                                     P.usage(payload.prompt_tokens, payload.completion_tokens)))  # fmt: skip
        return out

    return state.stream(job, render)
