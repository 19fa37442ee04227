"""POST /rerank, /v1/rerank (Jina's request and response) and /v2/rerank (Cohere's v2): the
`documents` ordered by their relevance to `query`, best first, each with its index in the
request; `top_n` keeps the best n, `return_documents` adds each document's text. Scores are a
cross-encoder's (sigmoid of its logit for the (query, document) pair) or, for an embedding model,
the cosine of the two embeddings; every document of a request is submitted at once."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import bad_request
from portside.server.pipeline import new_id
from portside.server.pooling_serving import check_count, check_truncate, pair_scores, require_pooler
from portside.server.protocol.common import OpenAIModel


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool | None = None  # default: true (Jina's), false on /v2/rerank (Cohere's v2 has none)
    max_tokens_per_doc: int | None = None  # Cohere's: each document cut to its first n tokens
    truncate_prompt_tokens: int | None = None  # vLLM's: each (query, document) prompt to n tokens
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None


def _check(req: RerankRequest) -> None:
    if not isinstance(req.query, str) or not req.query:
        raise bad_request("query: must be a non-empty string", "query")
    if not isinstance(req.documents, list) or not req.documents:
        raise bad_request("documents: must be a non-empty list of strings", "documents")
    for i, d in enumerate(req.documents):
        if not isinstance(d, str):
            raise bad_request(f"documents[{i}]: must be a string, got {type(d).__name__}", "documents")
    check_count(len(req.documents), "documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n: must be at least 1, got {req.top_n}", "top_n")
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise bad_request(f"max_tokens_per_doc: must be at least 1, got {req.max_tokens_per_doc}", "max_tokens_per_doc")


def _cut_documents(ctx: ServingContext, documents: list[str], k: int) -> list[str]:
    """Each document's first `k` tokens, as text (Cohere's max_tokens_per_doc)."""
    tok = ctx.offload.tokenizer()
    out = []
    for d in documents:
        ids = tok(d, add_special_tokens=False).input_ids
        out.append(d if len(ids) <= k else tok.decode(ids[:k]))
    return out


async def rerank(ctx: ServingContext, request: Request, cohere: bool) -> Response:
    pooler = require_pooler(ctx, "Rerank", "embed", "classify")
    req, _ = await parse_body(ctx, request, RerankRequest)
    lora = ctx.check_model(req.model) if req.model is not None else None
    _check(req)
    check_truncate(ctx, req.truncate_prompt_tokens)
    docs = req.documents
    if req.max_tokens_per_doc is not None:
        docs = await ctx.offload.run(_cut_documents, ctx, docs, req.max_tokens_per_doc, large=len(docs) > 64)
    request_id = new_id("rerank")
    scores, tokens = await pair_scores(ctx, request, request_id, pooler, [(req.query, d) for d in docs],
                                       req.truncate_prompt_tokens, req.priority, lora, "documents", req.use_activation)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    with_docs = req.return_documents if req.return_documents is not None else not cohere
    results = [{"index": i, **({"document": {"text": req.documents[i]}} if with_docs else {}), "relevance_score": scores[i]}
               for i in order]
    body: dict[str, Any] = {"id": request_id, "model": req.model or ctx.served_model_names[0],
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}
    if cohere:
        body["meta"] = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}
    return JSONResponse(body)


async def rerank_jina(ctx: ServingContext, request: Request) -> Response:
    return await rerank(ctx, request, cohere=False)


async def rerank_cohere(ctx: ServingContext, request: Request) -> Response:
    return await rerank(ctx, request, cohere=True)


ROUTES = (
    Route("POST", "/rerank", rerank_jina, counted=True),
    Route("POST", "/v1/rerank", rerank_jina, counted=True),
    Route("POST", "/v2/rerank", rerank_cohere, counted=True),
)
