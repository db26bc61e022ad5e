"""Several choices per request: ``n`` (and ``best_of``) generations per prompt, for one or several
prompts, each a :class:`~realizar.server.scheduler.Job` of its own; they run concurrently, in the
same batches.

Choice ``i`` of a prompt samples with ``seed + i`` when the request has a seed (independent yet
reproducible choices); without a seed each draws fresh entropy. Answers are collected whole
(:func:`collect_all`) or streamed as one Server-Sent Event stream whose chunks carry each choice's
``index`` (:func:`stream_all`); a client that goes away stops every job of its request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Request

from realizar.generation import GenerationResult, SamplingParams, TokenChunk
from realizar.server import protocol as P
from realizar.server.errors import as_server_error, served_file
from realizar.server.scheduler import Job
from realizar.server.state import EventStream, ServerState

__all__ = ["Outcome", "runs_for", "start_all", "collect_all", "stream_all", "best_of", "usage_of", "usage_tail", "failure",
           "TextRun"]

log = logging.getLogger("realizar.server")


@dataclass
class Outcome:
    """One finished generation: its text, result and every token chunk (with logprobs if asked)."""

    text: str
    result: GenerationResult
    chunks: list[TokenChunk] = field(default_factory=list)

    def mean_logprob(self) -> float:
        lps = [c.logprob for c in self.chunks if c.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")


def runs_for(ids: list[int], params: SamplingParams, count: int, logprobs: int | None) -> list[tuple[list[int], SamplingParams]]:
    """``count`` generations of ``ids``: choice ``i`` gets ``seed + i`` (mod 2**64) when seeded."""
    out = []
    for i in range(count):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        out.append((ids, replace(params, seed=seed, logprobs=logprobs)))
    return out


def start_all(state: ServerState, runs: Sequence[tuple[list[int], SamplingParams]]) -> list[Job]:
    """Queue every run; if one cannot be queued (429), the ones already queued are cancelled."""
    jobs: list[Job] = []
    try:
        for ids, params in runs:
            jobs.append(state.start(ids, params))
    except BaseException:
        cancel_all(state, jobs)
        raise
    return jobs


def cancel_all(state: ServerState, jobs: Sequence[Job]) -> None:
    for job in jobs:
        state.scheduler.cancel(job)


async def collect_all(state: ServerState, jobs: Sequence[Job], request: Request) -> list[Outcome]:
    """Every job's whole answer, in order; a failure or a disconnect stops the rest."""
    out: list[Outcome] = []
    try:
        for job in jobs:
            chunks: list[TokenChunk] = []
            text, result = await state.collect(job, request, chunks)
            out.append(Outcome(text, result, chunks))
    except BaseException:
        cancel_all(state, jobs)
        raise
    return out


def best_of(group: Sequence[Outcome], n: int) -> list[Outcome]:
    """The ``n`` outcomes with the highest mean logprob per token (OpenAI's ``best_of``), best first;
    all of them, in order, when there are no more than ``n``."""
    if len(group) <= n:
        return list(group)
    order = sorted(range(len(group)), key=lambda i: (-group[i].mean_logprob(), i))
    return [group[i] for i in order[:n]]


def usage_of(prompt_lengths: Sequence[int], completion_tokens: int) -> dict:
    """Usage of a request: each prompt counted once, however many choices it had."""
    return P.usage(int(sum(prompt_lengths)), int(completion_tokens))


def usage_tail(req: P.GenerationRequest, rid: str, ts: int, name: str, obj: str, jobs: Sequence[Job],
               prompt_lengths: Sequence[int]) -> Callable[[], list[dict]]:  # fmt: skip
    """The closing usage chunk of a stream (``stream_options.include_usage``), from the finished jobs."""

    def tail() -> list[dict]:
        if not req.include_usage():
            return []
        done = sum(j.result.completion_tokens for j in jobs if j.result is not None)
        return [P.usage_chunk(rid, ts, name, obj, usage_of(prompt_lengths, done))]

    return tail


Render = Callable[[int, str, Any], list[dict]]


def stream_all(state: ServerState, jobs: Sequence[Job], render: Render, tail: Callable[[], list[dict]]) -> EventStream:
    """The SSE response of ``jobs``: ``render(i, kind, payload)`` gives the chunks of job ``i``'s
    events (``"start"``, ``"tokens"`` (a list of chunks), ``"done"``); ``tail()`` the chunks after the last job (usage);
    it ends with ``data: [DONE]``."""
    return EventStream(_events(state, list(jobs), render, tail), lambda: cancel_all(state, jobs))


async def _events(state: ServerState, jobs: list[Job], render: Render, tail: Callable[[], list[dict]]) -> AsyncIterator[str]:
    finished = False
    try:
        ok = True
        for i, job in enumerate(jobs):
            for chunk in render(i, "start", None):
                yield _sse(chunk)
            async for kind, payload in job.events():
                if kind in ("error", "cancelled"):
                    if kind == "error":
                        yield _sse(failure(state, payload).body())
                    ok = False
                    break
                for chunk in render(i, kind, payload):
                    yield _sse(chunk)
            if not ok:
                cancel_all(state, jobs)
                break
        if ok:
            for chunk in tail():
                yield _sse(chunk)
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            cancel_all(state, jobs)


def failure(state: ServerState, exc: BaseException) -> P.ServerError:
    """The error a generation that failed mid-stream is reported with (logged when it is the server's)."""
    err = as_server_error(exc, served_file(state))
    if err.status >= 500:
        log.error("generation failed: %r", exc)
    return err


class TextRun:
    """One job's text as it comes, for the streams that send a single answer (``/v1/messages``,
    ``/v1/responses``): ``async for text in run`` gives each non-empty piece; after the loop ``text`` is all
    of it and ``result`` the job's GenerationResult, or None when it failed (``error``: what to report) or was
    cancelled (the client is gone)."""

    def __init__(self, state: ServerState, job: Job):
        self.state, self.job = state, job
        self.result: GenerationResult | None = None
        self.error: P.ServerError | None = None
        self._held: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._held)

    async def __aiter__(self) -> AsyncIterator[str]:
        async for kind, payload in self.job.events():
            if kind == "tokens":
                text = "".join(c.text for c in payload)
                self._held.append(text)
                if text:
                    yield text
            elif kind == "done":
                self.result = payload
            elif kind == "error":
                self.error = failure(self.state, payload)


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
