"""POST /score (vLLM's): a score per text pair, `text_1` (one text, or a list) against `text_2`
(one, or a list as long): a cross-encoder's activated logit of each pair, or the cosine of the
two texts' embeddings for an embedding model. Every pair of a request is submitted at once."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.pooling.inputs import score_pairs
from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import bad_request
from portside.server.pipeline import new_id
from portside.server.pooling_serving import check_count, check_truncate, pair_scores, require_pooler, usage
from portside.server.protocol.common import OpenAIModel


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: Any = None  # str | list[str]
    text_2: Any = None  # str | list[str]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # False: the cross-encoder's logit (no sigmoid)
    priority: int = 0
    user: str | None = None


def checked_pairs(first: Any, second: Any, names: tuple[str, str]) -> list[tuple[str, str]]:
    """`score_pairs` with its ValueError as a 400 naming the field."""
    for name, value in zip(names, (first, second)):
        if value is None:
            raise bad_request(f"{name}: is required (a string or a list of strings)", name)
        if not isinstance(value, (str, list)):
            raise bad_request(f"{name}: must be a string or a list of strings, got {type(value).__name__}", name)
    try:
        pairs = score_pairs(first, second, names)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":")[0].split("[")[0].split()[0]) from None
    check_count(len(pairs), names[1])
    return pairs


async def create_score(ctx: ServingContext, request: Request) -> Response:
    pooler = require_pooler(ctx, "Score", "embed", "classify")
    req, _ = await parse_body(ctx, request, ScoreRequest)
    lora = ctx.check_model(req.model) if req.model is not None else None
    check_truncate(ctx, req.truncate_prompt_tokens)
    pairs = checked_pairs(req.text_1, req.text_2, ("text_1", "text_2"))
    request_id = new_id("score")
    scores, tokens = await pair_scores(ctx, request, request_id, pooler, pairs, req.truncate_prompt_tokens, req.priority,
                                       lora, "text_2", req.use_activation)
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()), "model": req.model or ctx.served_model_names[0],
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], "usage": usage(tokens),
    })  # fmt: skip


ROUTES = (Route("POST", "/score", create_score, counted=True), Route("POST", "/v1/score", create_score, counted=True))
