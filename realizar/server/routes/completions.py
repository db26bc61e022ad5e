"""``POST /v1/completions``: text (or token-id) prompts continued, whole or streamed; ``n`` choices
per prompt (``best_of`` candidates ranked by mean logprob), ``logprobs: N`` per token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from realizar.server import choices as C
from realizar.server import protocol as P
from realizar.server.logprobs import TokenTexts, completion_logprobs
from realizar.server.state import ServerState, get_state, off_loop, parse_body

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _prompt(state: ServerState, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
    """Token ids of one prompt and its text (for ``echo``)."""
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise P.ServerError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        return state.check_ids(tok.encode(prompt)), prompt
    ids = state.check_ids(prompt)
    return ids, (tok.decode(ids) if echo else "")


def _prompts(state: ServerState, req: P.CompletionRequest) -> list[tuple[list[int], str]]:
    """Every prompt's ids and text (on a worker thread: tokenizing megabytes takes a while)."""
    req.refuse_unsupported()
    state.check_model(req.model)
    return [_prompt(state, p, bool(req.echo)) for p in req.prompts()]


@router.post("/v1/completions")
async def completions(request: Request, state: ServerState = Depends(get_state)) -> Any:
    req = await parse_body(request, P.CompletionRequest)
    prompts = await off_loop(request, _prompts, state, req)
    n = req.choices_per_prompt()
    tries = req.best_of or n
    # ranking best_of candidates needs each token's logprob even when the client asked for none
    lp = req.logprobs if tries == n else (req.logprobs or 0)
    runs = []
    for ids, _ in prompts:
        params = state.sampling(req, len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        runs += C.runs_for(ids, params, tries, lp)
    rid, ts, name = P.new_id("cmpl"), P.now(), state.name
    echoes = [text if req.echo else "" for _, text in prompts]
    texts = TokenTexts(state.engine.tokenizer)
    prompt_lengths = [len(ids) for ids, _ in prompts]
    jobs = C.start_all(state, runs)

    if not req.stream:
        outs = await C.collect_all(state, jobs, request)
        body = []
        for p, echo in enumerate(echoes):
            for i, out in enumerate(C.best_of(outs[p * tries : (p + 1) * tries], n)):
                logprobs = completion_logprobs(texts, out.chunks, len(echo)) if req.logprobs is not None else None
                body.append({"index": p * n + i, "text": echo + out.text, "logprobs": logprobs,
                             "finish_reason": out.result.finish_reason})  # fmt: skip
        u = C.usage_of(prompt_lengths, sum(o.result.completion_tokens for o in outs))
        return P.envelope(rid, ts, name, "text_completion", body, u)

    return C.stream_all(state, jobs, _stream_render(req, rid, ts, name, echoes, n, texts),
                        C.usage_tail(req, rid, ts, name, "text_completion", jobs, prompt_lengths))  # fmt: skip


def _stream_render(req: P.CompletionRequest, rid: str, ts: int, name: str, echoes: list[str], n: int,
                   texts: TokenTexts) -> C.Render:  # fmt: skip
    offsets = [0] * (len(echoes) * n)  # characters of each choice's text so far

    def chunk(i: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return P.envelope(rid, ts, name, "text_completion", [choice])

    def render(i: int, kind: str, payload: Any) -> list[dict]:
        if kind == "start":
            echo = echoes[i // n]
            offsets[i] = len(echo)
            return [chunk(i, echo, None, None)] if echo else []
        if kind == "tokens":
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(texts, payload, offsets[i])
            text = "".join(c.text for c in payload)
            offsets[i] += len(text)
            return [chunk(i, text, logprobs, None)] if text or logprobs else []
        return [chunk(i, "", None, payload.finish_reason)]

    return render

