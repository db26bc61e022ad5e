"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code"}}`` for every failure
(400 invalid request, 404 unknown model or path, 429 queue full, 500 engine failure)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from realizar.errors import (ContextOverflowError, InvalidRequestError, KVPoolExhaustedError, ModelOutputError,
                             RealizarError, TokenizerError, UnsupportedError)
from realizar.server import protocol as P
from realizar.serving.engine import EngineClosedError

__all__ = ["as_server_error", "install_error_handlers", "served_file"]

log = logging.getLogger("realizar.server")


def as_server_error(exc: BaseException, model: Any = None) -> P.ServerError:
    """The HTTP error an exception raised while serving stands for (``model``: the file served, named when
    the model itself failed)."""
    if isinstance(exc, P.ServerError):
        return exc
    if isinstance(exc, ModelOutputError):
        where = f"the model {model}" if model else "the model"
        return P.ServerError(500, f"{where} failed: {exc} (its weights or arithmetic are broken; check the file)",
                             "server_error", code="model_error")
    if isinstance(exc, ContextOverflowError):
        return P.ServerError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, EngineClosedError):  # (stopping, or its engine process is gone: another replica can answer)
        return P.ServerError(503, f"the serving engine stopped before this request finished ({exc}); retry it",
                             "server_error", code="engine_closed")
    if isinstance(exc, KVPoolExhaustedError):  # (an embedding's blocks while generations hold the pool)
        return P.ServerError(503, f"the KV cache is full ({exc}); retry when the running requests have finished",
                             "server_error", code="kv_cache_full")
    if isinstance(exc, UnsupportedError):
        return P.ServerError(501, str(exc), "invalid_request_error", code="unsupported")
    if isinstance(exc, (InvalidRequestError, TokenizerError)):
        return P.ServerError(400, str(exc), code="invalid_value")
    return P.ServerError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(err.get("msg", "")), None
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = str(err.get("msg", "invalid value"))
    return (f"{where}: {msg}" if where else msg), param


def _response(err: P.ServerError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _server_error(request: Request, exc: P.ServerError) -> JSONResponse:
    return _response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return _response(P.ServerError(400, message, param=param, code="invalid_value"))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(P.error_body(str(exc.detail), kind, None, code), status_code=exc.status_code,
                        headers=exc.headers)  # fmt: skip


async def _realizar_error(request: Request, exc: RealizarError) -> JSONResponse:
    return _response(as_server_error(exc, served_file(request.app.state.server)))


def served_file(state: Any) -> str | None:
    """The model file (or directory) a server's state serves, for messages."""
    path = getattr(state.engine, "path", None)
    return str(path) if path else getattr(state, "name", None)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error while serving %s", request.url.path)
    return _response(P.ServerError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(P.ServerError, _server_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RealizarError, _realizar_error)
    app.add_exception_handler(Exception, _internal_error)
