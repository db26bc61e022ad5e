"""``POST /v1/completions``: a text (or token-id) prompt continued, whole or streamed."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from realizar.server import protocol as P
from realizar.server.state import ServerState, get_state

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@router.post("/v1/completions")
async def completions(req: P.CompletionRequest, request: Request, state: ServerState = Depends(get_state)) -> Any:
    req.refuse_unsupported()
    state.check_model(req.model)
    prompt = req.single_prompt()
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise P.ServerError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        ids = state.check_ids(await asyncio.to_thread(tok.encode, prompt))
        prompt_text = prompt
    else:
        ids = state.check_ids(prompt)
        prompt_text = await asyncio.to_thread(tok.decode, ids) if req.echo else ""
    params = state.sampling(req, len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
    rid, ts, name = P.new_id("cmpl"), P.now(), state.name
    echo = prompt_text if req.echo else ""
    job = state.start(ids, params)

    if not req.stream:
        text, result = await state.collect(job, request)
        return P.completion_response(rid, ts, name, echo + text, result.finish_reason,
                                     P.usage(result.prompt_tokens, result.completion_tokens))  # fmt: skip

    include_usage = req.include_usage()

    def render(kind: str, payload: Any) -> list[dict]:
        if kind == "start":
            return [P.completion_chunk(rid, ts, name, echo, None)] if echo else []
        if kind == "token":
            return [P.completion_chunk(rid, ts, name, payload.text, None)] if payload.text else []
        out = [P.completion_chunk(rid, ts, name, "", payload.finish_reason)]
        if include_usage:
            out.append(P.usage_chunk(rid, ts, name, "text_completion",
                                     P.usage(payload.prompt_tokens, payload.completion_tokens)))  # fmt: skip
        return out

    return state.stream(job, render)
