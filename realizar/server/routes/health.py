"""``GET /health`` (liveness and queue state) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from realizar.server.metrics import CONTENT_TYPE
from realizar.server.state import ServerState, get_state

router = APIRouter()


@router.get("/health", response_model=None)
async def health(state: ServerState = Depends(get_state)) -> dict | JSONResponse:
    """200 and the queue's state; 503 ``{"status": "shutting down"}`` once shutdown started (routers and
    Kubernetes readiness probes then stop sending requests here)."""
    if state.scheduler.draining:
        return JSONResponse({"status": "shutting down", "model": state.name}, status_code=503)
    return {
        "status": "ok",
        "model": state.name,
        "device": state.device,
        "context_length": state.context_length,
        "queue_depth": state.scheduler.queue_depth,
        "busy": state.scheduler.busy,
    }


@router.get("/metrics")
async def metrics(state: ServerState = Depends(get_state)) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
