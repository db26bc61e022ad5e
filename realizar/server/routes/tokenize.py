"""``POST /tokenize`` and ``POST /detokenize`` (the shape of llama.cpp's server, plus vLLM's fields).

``/tokenize`` takes ``{"content": text}`` (special tokens such as BOS added only with
``add_special: true``), ``{"prompt": text}`` (added unless ``add_special: false``) or
``{"messages": [...]}`` (rendered with the chat template, generation prompt included unless
``add_generation_prompt: false``); it answers ``{"tokens", "count", "max_model_len"}``, and with
``with_pieces: true`` each token as ``{"id", "piece"}``. ``/detokenize`` takes ``{"tokens": [...]}``
and answers ``{"content": text}`` (also as ``prompt``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from realizar.errors import RealizarError
from realizar.server import protocol as P
from realizar.server.logprobs import TokenTexts
from realizar.server.state import ServerState, get_state, off_loop, parse_body

router = APIRouter()

MAX_TEXT = 1 << 22  # characters one request may ask to tokenize
MAX_TOKENS = 1 << 20  # ids one request may ask to detokenize


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    content: str | None = Field(default=None, max_length=MAX_TEXT)
    prompt: str | None = Field(default=None, max_length=MAX_TEXT)
    messages: list[P.ChatMessage] | None = Field(default=None, min_length=1)
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS)


def _ids(state: ServerState, req: TokenizeRequest) -> list[int]:
    given = [k for k in ("content", "prompt", "messages") if getattr(req, k) is not None]
    if len(given) != 1:
        raise P.ServerError(400, f"give exactly one of content, prompt or messages (got {given or 'none'})",
                            param="content", code="invalid_value")  # fmt: skip
    engine = state.engine
    add = req.add_special if req.add_special is not None else req.add_special_tokens
    try:
        if req.messages is not None:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            return list(engine.tokenizer.apply_chat_template(msgs, req.add_generation_prompt, tokenize=True))
        if req.content is not None:
            return list(engine.tokenizer.encode(req.content, add_special_tokens=bool(add)))
        return list(engine.tokenizer.encode(req.prompt, add_special_tokens=add is not False))
    except RealizarError as e:
        raise P.ServerError(400, f"cannot tokenize: {e}", param=given[0], code="invalid_value") from None


def _tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    if req.model is not None:
        state.check_model(req.model)
    ids = _ids(state, req)
    tokens: list[Any] = ids
    if req.with_pieces:
        texts = TokenTexts(state.engine.tokenizer)
        tokens = [{"id": t, "piece": texts.piece(t)[0]} for t in ids]
    return {"tokens": tokens, "count": len(ids), "max_model_len": state.context_length}


def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    if req.model is not None:
        state.check_model(req.model)
    for t in req.tokens:
        if not 0 <= t < state.vocab_size:
            raise P.ServerError(400, f"token id {t} is outside the vocabulary (0..{state.vocab_size - 1})",
                                param="tokens", code="invalid_value")  # fmt: skip
    text = state.engine.tokenizer.decode(req.tokens)
    return {"content": text, "prompt": text}


# (bodies are parsed, checked and (de)tokenized on worker threads: the event loop keeps answering)
@router.post("/tokenize")
async def tokenize(request: Request, state: ServerState = Depends(get_state)) -> dict:
    return await off_loop(request, _tokenize, state, await parse_body(request, TokenizeRequest))


@router.post("/detokenize")
async def detokenize(request: Request, state: ServerState = Depends(get_state)) -> dict:
    return await off_loop(request, _detokenize, state, await parse_body(request, DetokenizeRequest))
