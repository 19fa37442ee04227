"""POST /pooling (vLLM's): each input's vector as the pooling model computes it, whatever its
task (an embedding; a classifier's or reward model's logits, no activation), as float lists or
base64 (little-endian float32). Every input of a request is submitted at once."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.server.context import Route, ServingContext
from portside.server.endpoints.classify import PoolingInputRequest, prepared
from portside.server.endpoints.embeddings import encode_vector
from portside.server.pipeline import new_id
from portside.server.pooling_serving import run_pool, usage


class PoolingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"


async def create_pooling(ctx: ServingContext, request: Request) -> Response:
    _, req, ids = await prepared(ctx, request, "Pooling", PoolingRequest, "embed", "classify", "reward")
    lora = ctx.check_model(req.model) if req.model is not None else None
    request_id = new_id("pool")
    finals = await run_pool(ctx, request, request_id, ids, req.priority, "input", lora)
    data = [{"index": i, "object": "pooling", "data": encode_vector(list(o.pooled or []), req.encoding_format)}
            for i, o in enumerate(finals)]
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()), "model": req.model or ctx.served_model_names[0],
        "data": data, "usage": usage(sum(len(p) for p in ids)),
    })  # fmt: skip


ROUTES = (Route("POST", "/pooling", create_pooling, counted=True),)
