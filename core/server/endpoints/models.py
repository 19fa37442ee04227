"""GET /v1/models (the served names, then any LoRA adapters) and GET /v1/models/{model_id}."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.server.context import Route, ServingContext
from portside.server.errors import APIError


def model_cards(ctx: ServingContext) -> list[dict[str, Any]]:
    """The cards GET /v1/models lists: the served names, then any LoRA adapters."""
    cards = [
        {"id": name, "object": "model", "created": ctx.created, "owned_by": "portside", "root": name, "parent": None,
         "max_model_len": ctx.max_model_len}
        for name in ctx.served_model_names
    ]
    if ctx.adapters is not None:
        cards += ctx.adapters.model_cards(ctx.created, ctx.max_model_len)
    return cards


async def list_models(ctx: ServingContext, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": model_cards(ctx)})


async def get_model(ctx: ServingContext, request: Request) -> Response:
    """Its card, or a 404."""
    model_id = request.path_params["model_id"]
    for card in model_cards(ctx):
        if card["id"] == model_id:
            return JSONResponse(card)
    raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")


ROUTES = (
    Route("GET", "/v1/models", list_models),
    Route("GET", "/v1/models/{model_id:path}", get_model),
)
