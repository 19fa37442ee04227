"""vLLM's POST /tokenize (a prompt, or messages through the chat template as chat completions
render them) and POST /detokenize."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import bad_request
from portside.server.protocol.bodies import DetokenizeRequest, TokenizeRequest
from portside.server.rendering import check_template_fields, render_ids


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    req, large = await parse_body(ctx, request, TokenizeRequest)
    if req.model is not None:
        ctx.check_model(req.model)
    if req.messages is not None:
        check_template_fields(ctx, req)
    ids, strs = await ctx.offload.run(_tokenize, ctx, req, large=large or req.chat_template is not None)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


def _tokenize(ctx: ServingContext, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """On an offload worker, with its own tokenizer."""
    tok = ctx.offload.tokenizer()
    if req.prompt is not None:
        ids: list[int] = tok(req.prompt, add_special_tokens=req.add_special_tokens is not False).input_ids
    else:
        ids = render_ids(ctx, req)
    return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    req, large = await parse_body(ctx, request, DetokenizeRequest)
    if req.model is not None:
        ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is out of range for vocabulary size {ctx.vocab_size}", "tokens")
    text = await ctx.offload.run(lambda: ctx.offload.tokenizer().decode(req.tokens), large=large)
    return JSONResponse({"prompt": text})


ROUTES = (
    Route("POST", "/tokenize", tokenize),
    Route("POST", "/detokenize", detokenize),
)
