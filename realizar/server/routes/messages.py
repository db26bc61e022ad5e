"""``POST /v1/messages``: Anthropic's Messages API, answered whole or streamed as Anthropic's
Server-Sent Events (``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

The request is translated into a chat completions request (:mod:`realizar.server.anthropic`) and runs
through the chat endpoint's steps: the same template, sampling parameters, grammar for forced tools
(``tool_choice`` ``any`` / ``tool``) and tool-call parsing. With tools the answer is held back until it
is known to be text or calls (as the chat endpoint does), then sent as blocks; a tool's input goes out
as ``input_json_delta`` pieces. Errors take Anthropic's shape (:class:`AnthropicErrorMiddleware`).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from realizar.server import anthropic as A
from realizar.server import choices as C
from realizar.server.routes.chat import _prepare
from realizar.server.scheduler import Job
from realizar.server.state import EventStream, ServerState, get_state, off_loop, parse_body

router = APIRouter()

JSON_PIECE = 32  # characters of a tool's input per input_json_delta


@router.post("/v1/messages")
async def messages(request: Request, state: ServerState = Depends(get_state)) -> Any:
    body = await parse_body(request, A.MessagesRequest)
    req = await off_loop(request, body.chat_request)
    plan, ids, params = await off_loop(request, _prepare, state, req, heavy=bool(req.tools))
    rid = A.new_id("msg")
    tokenizer = state.engine.tokenizer

    def ending(text: str, result: Any) -> tuple[list[dict], str, str | None]:
        """The content blocks, stop reason and stop sequence of a finished generation."""
        msg, finish = {"role": "assistant", "content": text}, result.finish_reason
        if plan.parses_tools:
            msg, finish = plan.message(text, finish)
        decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        reason, seq = A.stop_reason(finish, params.stop, decode, result.token_ids)
        return A.content_blocks(msg), reason, seq

    jobs = C.start_all(state, C.runs_for(ids, params, 1, None))
    if not req.stream:
        (out,) = await C.collect_all(state, jobs, request)
        blocks, reason, seq = ending(out.text, out.result)
        return A.message(rid, state.name, blocks, reason, seq, len(ids), out.result.completion_tokens)
    events = _events(state, jobs[0], rid, len(ids), live=not plan.parses_tools, ending=ending)
    return EventStream(events, lambda: C.cancel_all(state, jobs))


async def _events(state: ServerState, job: Job, rid: str, n_in: int, live: bool, ending: Any) -> AsyncIterator[str]:
    """The stream of one generation: text deltas as they come when ``live``, else (with tools) every
    block once the generation is over."""
    finished = False
    try:
        yield A.sse("message_start", {"message": A.message(rid, state.name, [], None, None, n_in, 0)})
        if live:
            yield A.sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield A.sse("ping", {})
        run = C.TextRun(state, job)
        async for text in run:
            if live:
                yield A.sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        if run.error is not None:
            err = run.error
            yield A.sse("error", {"error": A.error_body(err.status, err.message, err.code)[1]["error"]})
            return
        if run.result is None:  # cancelled: the client is gone
            return
        blocks, reason, seq = ending(run.text, run.result)
        if live:
            yield A.sse("content_block_stop", {"index": 0})
        else:
            for i, block in enumerate(blocks):
                for event in _block_events(i, block):
                    yield event
        yield A.sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": {"output_tokens": run.result.completion_tokens}})  # fmt: skip
        yield A.sse("message_stop", {})
        finished = True
    finally:
        if not finished:
            C.cancel_all(state, [job])


def _block_events(index: int, block: dict) -> list[str]:
    """The events of one whole content block (text, or a tool call whose input goes in pieces)."""
    if block["type"] == "text":
        out = [A.sse("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})]
        if block["text"]:
            out.append(A.sse("content_block_delta", {"index": index,
                                                     "delta": {"type": "text_delta", "text": block["text"]}}))
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        out = [A.sse("content_block_start", {"index": index, "content_block": start})]
        text = json.dumps(block["input"], ensure_ascii=False)
        for k in range(0, len(text), JSON_PIECE):
            delta = {"type": "input_json_delta", "partial_json": text[k:k + JSON_PIECE]}
            out.append(A.sse("content_block_delta", {"index": index, "delta": delta}))
    out.append(A.sse("content_block_stop", {"index": index}))
    return out
