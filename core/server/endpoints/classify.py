"""POST /classify (vLLM's): each input's class probabilities from a classifier (softmax over its
labels, sigmoid for one), its most likely label (the config's id2label) and the class count.
Every input of a request is submitted at once."""

from __future__ import annotations

import time
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.pooling.outputs import activate
from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import bad_request
from portside.server.pipeline import new_id
from portside.server.pooling_serving import check_count, check_truncate, require_pooler, run_pool, tokenize_texts, usage
from portside.server.protocol.common import OpenAIModel, prompt_list


class PoolingInputRequest(OpenAIModel):
    """A pooling request's inputs: texts or token ids, as /v1/embeddings takes them."""

    model: str | None = None
    input: Any = None  # str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0
    user: str | None = None


class ClassificationRequest(PoolingInputRequest):
    use_activation: bool | None = None  # False: the logits (no softmax / sigmoid)


B = TypeVar("B", bound=PoolingInputRequest)


def checked_inputs(ctx: ServingContext, value: Any) -> list[Any]:
    """The request's inputs as a list, or a 400 naming `input` (missing, empty, mixed, too many)."""
    if value is None:
        raise bad_request("input: is required (a string, a list of strings, or token ids)", "input")
    try:
        items: list[Any] = prompt_list(value, empty_text=False)
    except ValueError as e:
        raise bad_request(f"input: {e}", "input") from None
    check_count(len(items), "input")
    return items


async def prepared(ctx: ServingContext, request: Request, api: str, body: type[B], *tasks: str) -> tuple[Any, B, list[list[int]]]:
    """(the pooler, the request, each input's token ids) of a /classify or /pooling request."""
    pooler = require_pooler(ctx, api, *tasks)
    req, _ = await parse_body(ctx, request, body)
    check_truncate(ctx, req.truncate_prompt_tokens)
    items = checked_inputs(ctx, req.input)
    ids = await ctx.offload.run(tokenize_texts, ctx, items, req.truncate_prompt_tokens, "input", req.add_special_tokens,
                                large=len(items) > 64)
    return pooler, req, ids


async def create_classification(ctx: ServingContext, request: Request) -> Response:
    pooler, req, ids = await prepared(ctx, request, "Classification", ClassificationRequest, "classify")
    lora = ctx.check_model(req.model) if req.model is not None else None
    request_id = new_id("classify")
    finals = await run_pool(ctx, request, request_id, ids, req.priority, "input", lora)
    data = []
    for i, out in enumerate(finals):
        probs = activate(pooler, list(out.pooled or []), req.use_activation)
        best = max(range(len(probs)), key=probs.__getitem__)
        label = pooler.labels[best] if best < len(pooler.labels) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()), "model": req.model or ctx.served_model_names[0],
        "data": data, "usage": usage(sum(len(p) for p in ids)),
    })  # fmt: skip


ROUTES = (Route("POST", "/classify", create_classification, counted=True),)
