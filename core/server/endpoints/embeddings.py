"""POST /v1/embeddings (a server running an embedding model: --runner pooling): one pooled vector
per input (through the model's Dense layers, L2-normalised), its first `dimensions` values
normalised again where asked (Matryoshka), as float lists or base64 (little-endian float32, as
OpenAI's). Inputs are texts, token ids, or one conversation through the chat template
(`portside.server.rendering`); every input of a request is submitted at once."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.pooling.inputs import resolve_prompt
from portside.pooling.outputs import check_dimensions, truncate_dimensions
from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import bad_request
from portside.server.pipeline import new_id, pool
from portside.server.pooling_serving import check_count, require_pooler, usage
from portside.server.protocol.bodies import EmbeddingRequest
from portside.server.rendering import check_template_fields, render_ids


async def create_embedding(ctx: ServingContext, request: Request) -> Response:
    pooler = require_pooler(ctx, "Embeddings", "embed")
    req, large = await parse_body(ctx, request, EmbeddingRequest)
    lora = ctx.check_model(req.model) if req.model is not None else None
    if req.messages is not None:
        check_template_fields(ctx, req)
    try:
        check_dimensions(pooler, req.dimensions)
    except ValueError as e:
        raise bad_request(str(e), "dimensions") from None
    if req.input is not None:
        check_count(len(req.input), "input")
    try:
        prefix = resolve_prompt(pooler)  # the folder's default_prompt_name's prompt, as sentence-transformers' encode
    except ValueError as e:
        raise bad_request(str(e)) from None
    prompts = await ctx.offload.run(_tokenize, ctx, req, prefix, large=large or req.chat_template is not None)
    request_id = new_id("embd")
    finals = await pool(ctx, request, request_id, list(prompts), req.priority, "input", lora)
    data = []
    for i, out in enumerate(finals):
        assert out.pooled is not None, f"{out.request_id}: a finished embedding request without its vector"
        vector = truncate_dimensions(out.pooled, req.dimensions, pooler.normalize)
        data.append({"index": i, "object": "embedding", "embedding": encode_vector(vector, req.encoding_format)})
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()), "model": req.model or ctx.served_model_names[0],
        "data": data, "usage": usage(sum(len(p) for p in prompts)),
    })  # fmt: skip


def _tokenize(ctx: ServingContext, req: EmbeddingRequest, prefix: str = "") -> list[list[int]]:
    """Each input's token ids (a text after `prefix`), truncated to its last `truncate_prompt_tokens`
    (on an offload worker)."""
    keep = ctx.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if keep is not None and keep > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens: {keep} is more than max_model_len {ctx.max_model_len}", "truncate_prompt_tokens")
    tok = ctx.offload.tokenizer()
    out = []
    items = req.input if req.messages is None else [render_ids(ctx, req)]
    for i, item in enumerate(items):
        param = ("input" if len(items) == 1 else f"input[{i}]") if req.messages is None else "messages"
        if isinstance(item, str):
            ids = tok(prefix + item if req.messages is None else item, add_special_tokens=req.add_special_tokens is not False).input_ids
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
            if bad:
                raise bad_request(f"{param}: token id {bad[0]} is out of range for vocabulary size {ctx.vocab_size}", "input")
        if keep is not None:
            ids = ids[-keep:]
        if not ids:
            raise bad_request(f"{param}: has no tokens", param.split("[")[0])
        if len(ids) > ctx.max_model_len:
            raise bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens, but {param} has "
                              f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens", param.split("[")[0])
        out.append(ids)
    return out


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


ROUTES = (Route("POST", "/v1/embeddings", create_embedding, counted=True),)
