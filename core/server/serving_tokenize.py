"""vLLM's utility endpoints: POST /tokenize (a prompt, or messages through the chat template, as
chat completions render them), POST /detokenize, GET /version and GET /v1/models/{model_id}."""

from __future__ import annotations

from typing import Any, cast

from fastapi import Request

import portside
from portside.chat_template import render_chat_ids
from portside.server.errors import APIError, bad_request
from portside.server.protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from portside.server.serving_base import ServingContext, parse_body
from portside.server.serving_chat import (
    REQUEST_TEMPLATE_BUDGET_S,
    REQUEST_TEMPLATE_MAX_CHARS,
    check_template_fields,
)
from portside.server.tools import template_messages


async def tokenize(ctx: ServingContext, request: Request) -> dict[str, Any]:
    req, large = await parse_body(ctx, request, TokenizeRequest)
    if req.model is not None:
        ctx.check_model(req.model)
    if req.messages is not None:
        check_template_fields(ctx, req)
    ids, strs = await ctx.offload.run(_tokenize, ctx, req, large=large or req.chat_template is not None)
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def _tokenize(ctx: ServingContext, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """On an offload worker, with its own tokenizer."""
    tok = ctx.offload.tokenizer()
    if req.prompt is not None:
        ids: list[int] = tok(req.prompt, add_special_tokens=req.add_special_tokens is not False).input_ids
    else:
        ids = render_messages(ctx, tok, req)
    return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None


def render_messages(ctx: ServingContext, tok: Any, req: TokenizeRequest | EmbeddingRequest) -> list[int]:
    """The request's messages through the chat template, as chat completions render them (on an
    offload worker); with add_special_tokens, wrapped in the tokenizer's own special tokens."""
    template = req.chat_template or ctx.chat_template
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template", "messages")
    untrusted = req.chat_template is not None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if getattr(req, "tools", None) else None  # type: ignore[union-attr]
    try:
        ids = render_chat_ids(
            tok, template_messages(cast(Any, req)), chat_template=template, tools=tools,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs, budget_s=REQUEST_TEMPLATE_BUDGET_S if untrusted else None,
            max_chars=REQUEST_TEMPLATE_MAX_CHARS if untrusted else None,
        )  # fmt: skip
    except Exception as e:  # as chat completions: a template's error is the request's fault
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    return _with_special_tokens(tok, ids) if req.add_special_tokens else ids


def _with_special_tokens(tok: Any, ids: list[int]) -> list[int]:
    """`ids` wrapped in the special tokens the tokenizer adds around a text (a BOS, say)."""
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a", add_special_tokens=True).input_ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i] + ids + full[i + len(plain) :]
    return ids


async def detokenize(ctx: ServingContext, request: Request) -> dict[str, Any]:
    req, large = await parse_body(ctx, request, DetokenizeRequest)
    if req.model is not None:
        ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is out of range for vocabulary size {ctx.vocab_size}", "tokens")
    text = await ctx.offload.run(lambda: ctx.offload.tokenizer().decode(req.tokens), large=large)
    return {"prompt": text}


def version() -> dict[str, Any]:
    return {"version": portside.__version__}


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


def model_card(ctx: ServingContext, model_id: str) -> dict[str, Any]:
    """GET /v1/models/{model_id}: its card, or a 404."""
    for card in model_cards(ctx):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
