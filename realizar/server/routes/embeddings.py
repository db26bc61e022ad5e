"""``POST /v1/embeddings`` (OpenAI's shape): unit-norm sentence embeddings of one input or many.

``input`` is a string, a list of strings, a list of token ids or a list of such lists (at most
:data:`MAX_INPUTS` inputs, each within the context, :data:`MAX_TOTAL_TOKENS` in all); each is pooled from the
model's final-norm hidden states as its metadata says (:mod:`realizar.embeddings`). ``encoding_format``:
``"float"`` (default) or ``"base64"`` (little-endian float32, as OpenAI's, and what the official client asks for);
``dimensions`` below the hidden size truncates and renormalises (Matryoshka). The work runs on a worker thread:
on the CPU, the engine's reference model beside the generations (:meth:`realizar.engine.Engine.embed`); on a GPU,
and with the engine in a process of its own, the serving engine between its steps, each input prefilled through KV
blocks of its own (:meth:`realizar.serving.ServingEngine.embed`; a pool too full for it: 503).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from realizar.server import protocol as P
from realizar.server.state import ServerState, get_state, off_loop, parse_body

router = APIRouter()

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
MAX_TOTAL_TOKENS = 1 << 18  # tokens per request, over all its inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    input: Any  # (checked by _inputs, whose messages say which input is wrong)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _bad(message: str, param: str = "input", code: str = "invalid_value") -> P.ServerError:
    return P.ServerError(400, message, param=param, code=code)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def _embedder(state: ServerState) -> Any:
    """What computes this server's embeddings: the engine's own :meth:`~realizar.engine.Engine.embed` where it has
    one (the CPU reference model), else the serving engine's (GPU backends, an engine process); a 501 without."""
    unavailable = getattr(state.engine, "embedding_unavailable", None)
    if unavailable is not None and unavailable() is None:
        return state.engine
    serving = state.scheduler.serving
    backend = getattr(serving, "backend", None)  # (None for an engine process: its engine says when it cannot)
    if callable(getattr(serving, "embed", None)) and (backend is None or hasattr(backend, "hidden_rows")):
        return serving
    why = unavailable() if unavailable is not None else "this server's engine does not compute embeddings"
    raise P.ServerError(501, why, "invalid_request_error", code="unsupported")


def _inputs(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    """Every input's token ids, checked (on a worker thread: tokenizing many texts takes a while)."""
    if req.dimensions is not None and not 1 <= req.dimensions <= state.engine.config.hidden_size:
        raise _bad(f"dimensions must be between 1 and the model's {state.engine.config.hidden_size}, got "
                   f"{req.dimensions}", param="dimensions")  # fmt: skip
    raw = req.input
    if isinstance(raw, str) or _is_ids(raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise _bad("input must be a non-empty string, a non-empty list of strings, a list of token ids or a list "
                   "of lists of token ids")  # fmt: skip
    if len(raw) > MAX_INPUTS:
        raise _bad(f"input has {len(raw)} items; at most {MAX_INPUTS} per request")
    out, total, ctx, vocab = [], 0, state.context_length, state.vocab_size
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise _bad(f"input[{i}] is an empty string")
            ids = list(state.engine.tokenizer.encode(item))
        elif _is_ids(item):
            ids = item
            for t in ids:
                if not 0 <= t < vocab:
                    raise _bad(f"input[{i}]: token id {t} is outside the vocabulary (0..{vocab - 1})")
        else:
            raise _bad(f"input[{i}] must be a non-empty string or a non-empty list of token ids, got "
                       f"{type(item).__name__}{' (empty)' if item == [] else ''}")  # fmt: skip
        if not ids:
            raise _bad(f"input[{i}] has no tokens")
        if len(ids) > ctx:
            raise _bad(f"input[{i}] has {len(ids)} tokens; this model's maximum context length is {ctx}",
                       code="context_length_exceeded")  # fmt: skip
        total += len(ids)
        if total > MAX_TOTAL_TOKENS:
            raise _bad(f"the inputs have more than {MAX_TOTAL_TOKENS} tokens in all; split the request")
        out.append(ids)
    return out


def _encode(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def _body(state: ServerState, req: EmbeddingRequest, embedder: Any, inputs: list[list[int]]) -> dict:
    vectors = embedder.embed(inputs, req.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    n = sum(len(ids) for ids in inputs)
    return {"object": "list", "data": data, "model": state.name, "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/embeddings")
async def embeddings(request: Request, state: ServerState = Depends(get_state)) -> dict:
    req = await parse_body(request, EmbeddingRequest)
    state.check_model(req.model)
    embedder = _embedder(state)  # (a 501 before any input is tokenized)
    inputs = await off_loop(request, _inputs, state, req)
    return await off_loop(request, _body, state, req, embedder, inputs, heavy=True)
