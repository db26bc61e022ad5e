"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from realizar.server.state import ServerState, get_state

router = APIRouter()


def _model_card(state: ServerState) -> dict:
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "realizar",
            "context_length": state.context_length}  # fmt: skip


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> dict:
    state.check_model(model_id)
    return _model_card(state)
