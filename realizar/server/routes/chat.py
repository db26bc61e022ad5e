"""``POST /v1/chat/completions``: messages rendered with the model's chat template, answered whole
or streamed; ``n`` choices, ``logprobs``/``top_logprobs`` per token; ``response_format`` and forced
``tool_choice`` constrain the sampling to a JSON grammar, and with ``tools`` the answer is parsed into
``tool_calls`` (see :mod:`realizar.server.structured_chat`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from realizar.errors import RealizarError
from realizar.server import choices as C
from realizar.server import protocol as P
from realizar.server.logprobs import TokenTexts, chat_logprobs
from realizar.server.state import ServerState, get_state, off_loop, parse_body
from realizar.server.structured_chat import plan_chat

router = APIRouter()


def _chat_prompt(engine: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    extra = {"tools": tools} if tools else {}
    render = getattr(engine, "chat_prompt", None)
    if callable(render):
        return list(render(messages, **extra))
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra))


def _prepare(state: ServerState, req: P.ChatCompletionRequest) -> tuple[Any, list[int], Any]:
    """The chat plan, prompt ids and sampling parameters of ``req`` (on a worker thread: a large
    conversation takes a while to check and render)."""
    req.refuse_unsupported()
    state.check_model(req.model)
    eos = getattr(getattr(state.engine, "generator", None), "eos_token_ids", ())
    plan = plan_chat(req, state.engine.tokenizer, eos)
    messages = plan.messages(req.plain_messages())
    try:
        ids = _chat_prompt(state.engine, messages, plan.template_tools())
    except RealizarError as e:
        raise P.ServerError(400, f"cannot apply the chat template: {e}", param="messages",
                            code="invalid_value") from None  # fmt: skip
    ids = state.check_ids(list(ids))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # (one grammar processor serves every choice: the choices run in the same batch, and it follows
    # whichever sequence it is shown, rolling back to where that one departs from the last)
    params = plan.constrain(state.sampling(req, len(ids), req.requested_max_tokens(), state.default_max_tokens, param))
    return plan, ids, params


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: ServerState = Depends(get_state)) -> Any:
    req = await parse_body(request, P.ChatCompletionRequest)
    plan, ids, params = await off_loop(request, _prepare, state, req, heavy=bool(req.response_format or req.tools))
    rid, ts, name = P.new_id("chatcmpl"), P.now(), state.name
    n, lp = req.choices_per_prompt(), req.logprobs_wanted()
    texts = TokenTexts(state.engine.tokenizer)
    jobs = C.start_all(state, C.runs_for(ids, params, n, lp))

    if not req.stream:
        outs = await C.collect_all(state, jobs, request)
        body = []
        for i, out in enumerate(outs):
            message, finish = {"role": "assistant", "content": out.text}, out.result.finish_reason
            if plan.parses_tools:
                message, finish = plan.message(out.text, finish)
            body.append({"index": i, "message": message,
                         "logprobs": chat_logprobs(texts, out.chunks) if lp is not None else None,
                         "finish_reason": finish})  # fmt: skip
        u = C.usage_of([len(ids)], sum(o.result.completion_tokens for o in outs))
        return P.envelope(rid, ts, name, "chat.completion", body, u)

    def chunk(i: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return P.envelope(rid, ts, name, "chat.completion.chunk", [choice])

    held: dict[int, list[str]] = {}  # with tools, each choice's text is held back until it is known to be calls

    def render(i: int, kind: str, payload: Any) -> list[dict]:
        if kind == "start":
            return [chunk(i, {"role": "assistant", "content": ""}, None, None)]
        if kind == "tokens":
            logprobs = chat_logprobs(texts, payload) if lp is not None else None
            text = "".join(c.text for c in payload)
            if plan.parses_tools:
                held.setdefault(i, []).append(text)
                return [chunk(i, {}, logprobs, None)] if logprobs else []
            return [chunk(i, {"content": text}, logprobs, None)] if text or logprobs else []
        finish, out = payload.finish_reason, []
        if plan.parses_tools:
            message, finish = plan.message("".join(held.pop(i, [])), finish)
            delta = {"content": message["content"]} if message.get("content") else {}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
            if delta:
                out.append(chunk(i, delta, None, None))
        out.append(chunk(i, {}, None, finish))
        return out

    tail = C.usage_tail(req, rid, ts, name, "chat.completion.chunk", jobs, [len(ids)])
    return C.stream_all(state, jobs, render, tail)
