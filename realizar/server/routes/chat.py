"""``POST /v1/chat/completions``: messages rendered with the model's chat template, answered whole
or streamed."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from realizar.errors import RealizarError
from realizar.server import protocol as P
from realizar.server.state import ServerState, get_state

router = APIRouter()


def _chat_prompt(engine: Any, messages: list[dict]) -> list[int]:
    render = getattr(engine, "chat_prompt", None)
    if callable(render):
        return list(render(messages))
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@router.post("/v1/chat/completions")
async def chat_completions(req: P.ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)) -> Any:
    req.refuse_unsupported()
    state.check_model(req.model)
    messages = req.plain_messages()
    try:
        ids = await asyncio.to_thread(_chat_prompt, state.engine, messages)
    except RealizarError as e:
        raise P.ServerError(400, f"cannot apply the chat template: {e}", param="messages",
                            code="invalid_value") from None  # fmt: skip
    ids = state.check_ids(list(ids))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = state.sampling(req, len(ids), req.requested_max_tokens(), state.default_max_tokens, param)
    rid, ts, name = P.new_id("chatcmpl"), P.now(), state.name
    job = state.start(ids, params)

    if not req.stream:
        text, result = await state.collect(job, request)
        return P.chat_response(rid, ts, name, text, result.finish_reason,
                               P.usage(result.prompt_tokens, result.completion_tokens))  # fmt: skip

    include_usage = req.include_usage()

    def render(kind: str, payload: Any) -> list[dict]:
        if kind == "start":
            return [P.chat_chunk(rid, ts, name, {"role": "assistant", "content": ""}, None)]
        if kind == "token":
            return [P.chat_chunk(rid, ts, name, {"content": payload.text}, None)] if payload.text else []
        out = [P.chat_chunk(rid, ts, name, {}, payload.finish_reason)]
        if include_usage:
            out.append(P.usage_chunk(rid, ts, name, "chat.completion.chunk",
                                     P.usage(payload.prompt_tokens, payload.completion_tokens)))  # fmt: skip
        return out

    return state.stream(job, render)
