"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`portside.server.lora`), on a
server started with --enable-lora and --allow-runtime-lora-updating."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from portside.server.context import Route, ServingContext, json_object
from portside.server.errors import APIError
from portside.server.lora import load_adapter, unload_adapter


async def load(ctx: ServingContext, request: Request) -> Response:
    _check_updates(ctx)
    return PlainTextResponse(await load_adapter(ctx.adapters, ctx.engine, ctx.offload, await json_object(request),
                                                ctx.served_model_names))


async def unload(ctx: ServingContext, request: Request) -> Response:
    _check_updates(ctx)
    return PlainTextResponse(await unload_adapter(ctx.adapters, ctx.engine, await json_object(request)))


def _check_updates(ctx: ServingContext) -> None:
    if ctx.adapters is None:
        raise APIError(400, "LoRA adapters are not enabled on this server (--enable-lora)", code="lora_disabled")
    if not ctx.allow_runtime_lora_updating:
        raise APIError(400, "loading and unloading adapters while serving is off; start the server with "
                       "--allow-runtime-lora-updating", code="runtime_lora_updating_disabled")


ROUTES = (
    Route("POST", "/v1/load_lora_adapter", load),
    Route("POST", "/v1/unload_lora_adapter", unload),
)
