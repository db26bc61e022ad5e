"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves, under its id and its
aliases (each listed)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from realizar.server.state import ServerState, get_state

router = APIRouter()


def _model_card(state: ServerState, name: str) -> dict:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "realizar",
            "context_length": state.context_length}  # fmt: skip
    if name != state.name:
        card["root"] = state.name  # (an alias of the model's id)
    return card


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)) -> dict:
    return {"object": "list", "data": [_model_card(state, n) for n in state.names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> dict:
    state.check_model(model_id)
    return _model_card(state, model_id)
