"""The development endpoints reinforcement-learning frameworks drive a rollout server with, as
vLLM names them; served only with --enable-dev-endpoints (404 otherwise):

- POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache], GET /is_sleeping;
- POST /pause?mode=abort|wait|keep[&clear_cache=true] (vLLM's wait_for_inflight_requests=true
  is mode=wait), POST /resume, GET /is_paused;
- POST /reset_prefix_cache;
- POST /collective_rpc {"method": NAME, "args": [...], "kwargs": {...}}: a `ModelRunner` method
  on every rank, {"results": [one per rank]};
- POST /update_weights_from_path {"path": FOLDER}: a safetensors checkpoint's tensors into the
  running model, {"num_tensors": n}.

Each runs on the engine thread between steps (`AsyncEngineControl.call`). Bad input (an unknown
level, tag, mode, method or parameter name, a wrong shape or dtype, an update while the weights
sleep) is a 400 naming it, with the model unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.server.context import Route, ServingContext, json_object
from portside.server.errors import APIError


def _engine(ctx: ServingContext, request: Request) -> Any:
    if not getattr(request.app.state, "dev_endpoints", False):
        raise APIError(404, f"{request.url.path} is served with --enable-dev-endpoints only", code="not_found")
    engine = ctx.engine
    if not hasattr(engine, "call"):
        raise APIError(400, "the dev endpoints need one engine (data_parallel_size 1)")
    return engine


async def _run(engine: Any, fn: Any) -> Any:
    try:
        return await engine.call(fn)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise APIError(400, str(e), code="invalid_value") from None


def _query_bool(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise APIError(400, f"{name} must be true or false, got {value!r}", param=name, code="invalid_value")


async def sleep(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    raw = request.query_params.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise APIError(400, f"level must be 1 or 2, got {raw!r}", param="level", code="invalid_value") from None
    await _run(engine, lambda e: e.sleep(level))
    return JSONResponse({"is_sleeping": True, "level": level})


async def wake_up(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    tags = request.query_params.getlist("tags") or None
    await _run(engine, lambda e: e.wake_up(tags))
    return JSONResponse({"is_sleeping": await engine.call(lambda e: e.is_sleeping)})


async def is_sleeping(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    return JSONResponse({"is_sleeping": bool(getattr(engine.engine, "is_sleeping", False))})


async def pause(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    wait = _query_bool(request, "wait_for_inflight_requests", False)
    mode = request.query_params.get("mode", "wait" if wait else "abort")
    try:
        await engine.pause(mode, clear_cache=_query_bool(request, "clear_cache", True))
    except ValueError as e:
        raise APIError(400, str(e), param="mode", code="invalid_value") from None
    return JSONResponse({"is_paused": True})


async def resume(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    await engine.resume()
    return JSONResponse({"is_paused": False})


async def is_paused(ctx: ServingContext, request: Request) -> Response:
    return JSONResponse({"is_paused": _engine(ctx, request).is_paused})


async def reset_prefix_cache(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    await _run(engine, lambda e: e.reset_prefix_cache())
    return JSONResponse({})


async def collective_rpc(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    body = await json_object(request, "invalid_value")
    method, args, kwargs = body.get("method"), body.get("args", []), body.get("kwargs", {})
    if not isinstance(method, str) or not method:
        raise APIError(400, "method must be the name of a model runner method", param="method", code="invalid_value")
    if not isinstance(args, list):
        raise APIError(400, "args must be a list", param="args", code="invalid_value")
    if not isinstance(kwargs, dict):
        raise APIError(400, "kwargs must be an object", param="kwargs", code="invalid_value")
    results = await _run(engine, lambda e: e.collective_rpc(method, tuple(args), kwargs))
    return JSONResponse({"results": [_jsonable(r) for r in results]})


async def update_weights_from_path(ctx: ServingContext, request: Request) -> Response:
    engine = _engine(ctx, request)
    path = (await json_object(request, "invalid_value")).get("path")
    if not isinstance(path, str) or not path:
        raise APIError(400, "path must be the folder of a safetensors checkpoint", param="path", code="invalid_value")
    n = await _run(engine, lambda e: e.update_weights_from_path(path))
    return JSONResponse({"num_tensors": n})


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


ROUTES = (
    Route("POST", "/sleep", sleep),
    Route("POST", "/wake_up", wake_up),
    Route("GET", "/is_sleeping", is_sleeping),
    Route("POST", "/pause", pause),
    Route("POST", "/resume", resume),
    Route("GET", "/is_paused", is_paused),
    Route("POST", "/reset_prefix_cache", reset_prefix_cache),
    Route("POST", "/collective_rpc", collective_rpc),
    Route("POST", "/update_weights_from_path", update_weights_from_path),
)
