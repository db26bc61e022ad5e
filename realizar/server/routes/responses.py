"""``POST /v1/responses``: OpenAI's Responses API (stateless), answered whole or streamed as OpenAI's
Server-Sent Events (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``response.completed``), each
``data`` with its ``type`` and ``sequence_number``.

The request is translated into a chat completions request (:mod:`realizar.server.responses_api`) and
runs through the chat endpoint's steps: the same template, sampling parameters, grammar for
``text.format`` and forced tools, and tool-call parsing. With tools the answer is held back until it
is known to be text or calls (as the chat endpoint does), then sent as items; a call's arguments go out
as ``response.function_call_arguments.delta`` pieces.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request

from realizar.server import choices as C
from realizar.server import protocol as P
from realizar.server import responses_api as R
from realizar.server.anthropic import new_id, sse
from realizar.server.routes.chat import _prepare
from realizar.server.scheduler import Job
from realizar.server.state import EventStream, ServerState, get_state, off_loop, parse_body

router = APIRouter()

JSON_PIECE = 32  # characters of a call's arguments per response.function_call_arguments.delta


@router.post("/v1/responses")
async def responses(request: Request, state: ServerState = Depends(get_state)) -> Any:
    body = await parse_body(request, R.ResponsesRequest)
    req = await off_loop(request, body.chat_request)
    plan, ids, params = await off_loop(request, _prepare, state, req, heavy=bool(req.tools or req.response_format))
    rid, created = new_id("resp"), P.now()

    def response(output: list[dict], status: str, n_out: int = 0) -> dict:
        return R.response_object(rid, created, state.name, body, output, status, len(ids), n_out)

    def ending(text: str, result: Any) -> dict:
        """The finished response of a generation."""
        msg, finish = {"role": "assistant", "content": text}, result.finish_reason
        if plan.parses_tools:
            msg, finish = plan.message(text, finish)
        incomplete = finish == "length"
        return response(R.output_items(msg, incomplete), "incomplete" if incomplete else "completed",
                        result.completion_tokens)  # fmt: skip

    jobs = C.start_all(state, C.runs_for(ids, params, 1, None))
    if not req.stream:
        (out,) = await C.collect_all(state, jobs, request)
        return ending(out.text, out.result)
    events = _events(state, jobs[0], response, live=not plan.parses_tools, ending=ending)
    return EventStream(events, lambda: C.cancel_all(state, jobs))


class _Seq:
    """The stream's events, numbered."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, event: str, **data: Any) -> str:
        self.n += 1
        return sse(event, {"sequence_number": self.n - 1, **data})


async def _events(state: ServerState, job: Job, response: Callable[..., dict], live: bool,
                  ending: Callable[[str, Any], dict]) -> AsyncIterator[str]:  # fmt: skip
    """The stream of one generation: text deltas as they come when ``live``, else (with tools) every
    item once the generation is over."""
    ev, finished = _Seq(), False
    mid = new_id("msg")
    try:
        start = response([], "in_progress")
        yield ev("response.created", response=start)
        yield ev("response.in_progress", response=start)
        if live:
            for e in _message_open(ev, 0, mid):
                yield e
        run = C.TextRun(state, job)
        async for text in run:
            if live:
                yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=text,
                         logprobs=[])  # fmt: skip
        if run.error is not None:
            err = run.error
            yield ev("error", code=err.code, message=err.message, param=err.param)
            return
        if run.result is None:  # cancelled: the client is gone
            return
        final = ending(run.text, run.result)
        for i, item in enumerate(final["output"]):
            if live:
                item["id"] = mid  # (the item already announced)
            for e in _item_events(ev, i, item, opened=live):
                yield e
        yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
        finished = True
    finally:
        if not finished:
            C.cancel_all(state, [job])


def _message_open(ev: _Seq, index: int, mid: str) -> list[str]:
    item = {"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    return [ev("response.output_item.added", output_index=index, item=item),
            ev("response.content_part.added", item_id=mid, output_index=index, content_index=0, part=part)]


def _item_events(ev: _Seq, index: int, item: dict, opened: bool) -> list[str]:
    """The events of one whole output item (from ``response.output_item.added`` on, or, when ``opened``,
    a message item whose text has been sent already, from ``response.output_text.done`` on)."""
    iid = item["id"]
    if item["type"] == "message":
        out = [] if opened else _message_open(ev, index, iid)
        part = item["content"][0]
        if part["text"] and not opened:
            out.append(ev("response.output_text.delta", item_id=iid, output_index=index, content_index=0,
                          delta=part["text"], logprobs=[]))  # fmt: skip
        out += [ev("response.output_text.done", item_id=iid, output_index=index, content_index=0, text=part["text"],
                   logprobs=[]),
                ev("response.content_part.done", item_id=iid, output_index=index, content_index=0, part=part)]
    else:
        out = [ev("response.output_item.added", output_index=index,
                  item={**item, "arguments": "", "status": "in_progress"})]
        args = item["arguments"]
        for k in range(0, len(args), JSON_PIECE):
            out.append(ev("response.function_call_arguments.delta", item_id=iid, output_index=index,
                          delta=args[k:k + JSON_PIECE]))  # fmt: skip
        out.append(ev("response.function_call_arguments.done", item_id=iid, output_index=index, name=item["name"],
                      arguments=args))  # fmt: skip
    out.append(ev("response.output_item.done", output_index=index, item=item))
    return out
