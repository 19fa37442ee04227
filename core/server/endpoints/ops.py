"""What operators and orchestrators call: GET /health (the only route open without the API
key), GET /metrics (Prometheus) and GET /version."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

import portside
from portside.server.context import Route, ServingContext
from portside.server.errors import APIError
from portside.server.metrics import CONTENT_TYPE


async def health(ctx: ServingContext, request: Request) -> Response:
    engine = ctx.engine
    if not engine.is_running:
        reason = getattr(engine, "stopped_reason", None)  # data parallelism: which replica failed
        return APIError(503, reason() if reason is not None else "the engine is not running").response()
    return JSONResponse({"status": "ok"})


async def metrics(ctx: ServingContext, request: Request) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def version(ctx: ServingContext, request: Request) -> Response:
    return JSONResponse({"version": portside.__version__})


ROUTES = (
    Route("GET", "/health", health),
    Route("GET", "/metrics", metrics),
    Route("GET", "/version", version),
)
