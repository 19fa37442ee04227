"""What the pooling endpoints share (/v1/embeddings, /score, /rerank, /classify, /pooling): the
model's pooler and a 400 naming the mismatch when the server runs another task, the input-count
limit, tokenization on an offload worker (texts or text pairs, `truncate_prompt_tokens`, a too
long input refused with its length), submission of every input of a request together (the
scheduler batches them: no per-input forward), and vLLM's usage block."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from portside.config import PoolerConfig
from portside.outputs import RequestOutput
from portside.pooling.inputs import pair_prompt, truncate_ids
from portside.pooling.outputs import activate, cosine
from portside.server.context import ServingContext
from portside.server.errors import APIError, bad_request
from portside.server.pipeline import pool

MAX_INPUTS = 2048  # inputs (texts, pairs, documents) in one request; more is a 400 naming the field

_TASK_API = {"embed": "/v1/embeddings, /score, /rerank, /pooling", "classify": "/classify, /score, /rerank, /pooling",
             "reward": "/pooling"}


_ARTICLE = {"embed": "an", "classify": "a", "reward": "a"}


def require_pooler(ctx: ServingContext, api: str, *tasks: str) -> PoolerConfig:
    """The served model's PoolerConfig; 400 when it generates, or pools for another task."""
    config = getattr(ctx.engine.engine, "config", None)
    pooler: PoolerConfig | None = getattr(getattr(config, "model", None), "pooler", None)
    if pooler is None:
        raise APIError(400, f"The model does not support the {api} API: this server generates text; start it with "
                            "--runner pooling (a pooling model: embedding, classifier or cross-encoder)",
                       code="task_not_supported")
    if pooler.task not in tasks:
        raise APIError(400, f"The model does not support the {api} API: this server runs {_ARTICLE[pooler.task]} {pooler.task} model "
                            f"(--runner pooling, task {pooler.task}), which serves {_TASK_API[pooler.task]}",
                       code="task_not_supported")
    return pooler


def check_count(n: int, field: str) -> None:
    if n > MAX_INPUTS:
        raise bad_request(f"{field}: {n} inputs, more than the {MAX_INPUTS} one request may hold; split the request", field)


def check_truncate(ctx: ServingContext, k: int | None) -> None:
    if k is not None and (k == 0 or k < -1):
        raise bad_request("truncate_prompt_tokens: must be -1 (max_model_len) or at least 1", "truncate_prompt_tokens")
    if k is not None and k > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens: {k} is more than max_model_len {ctx.max_model_len}",
                          "truncate_prompt_tokens")


def _too_long(ctx: ServingContext, n: int, where: str, field: str) -> APIError:
    return bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens, but {where} has {n} tokens; "
                       "shorten it or set truncate_prompt_tokens", field)


def tokenize_texts(ctx: ServingContext, items: list[Any], truncate: int | None, field: str,
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Each text's (or token-id list's) ids, on an offload worker: its last `truncate` tokens."""
    tok = ctx.offload.tokenizer()
    out = []
    for i, item in enumerate(items):
        where = field if len(items) == 1 else f"{field}[{i}]"
        if isinstance(item, str):
            ids = tok(item, add_special_tokens=add_special_tokens).input_ids
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
            if bad:
                raise bad_request(f"{where}: token id {bad[0]} is out of range for vocabulary size {ctx.vocab_size}", field)
        ids = truncate_ids(ids, truncate, ctx.max_model_len)
        if not ids:
            raise bad_request(f"{where}: has no tokens", field)
        if len(ids) > ctx.max_model_len:
            raise _too_long(ctx, len(ids), where, field)
        out.append(ids)
    return out


def tokenize_pairs(ctx: ServingContext, model_path: str, pairs: list[tuple[str, str]], truncate: int | None,
                   field: str) -> list[dict[str, Any]]:
    """Each (first, second) pair as one prompt, tokenized as a text pair (a cross-encoder's input)."""
    tok = ctx.offload.tokenizer()
    keep = ctx.max_model_len if truncate == -1 else truncate
    out = []
    for i, (a, b) in enumerate(pairs):
        try:
            out.append(pair_prompt(tok, model_path, a, b, keep, ctx.max_model_len))
        except ValueError:
            n = len(tok(a, b).input_ids)
            raise _too_long(ctx, n, f"{field}[{i}] with its query", field) from None
    return out


async def run_pool(ctx: ServingContext, request: Request, request_id: str, prompts: list[Any], priority: int, field: str,
                   lora: Any) -> list[RequestOutput]:
    """Every prompt submitted at once (all or none); their finished outputs, in order."""
    return await pool(ctx, request, request_id, prompts, priority, field, lora)


def usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's UsageInfo: OpenAI's prompt_tokens and total_tokens, completion_tokens 0, details null."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def model_path(ctx: ServingContext) -> str:
    return str(ctx.engine.engine.config.model.path)


async def pair_scores(ctx: ServingContext, request: Request, request_id: str, pooler: PoolerConfig,
                      pairs: list[tuple[str, str]], truncate: int | None, priority: int, lora: Any, field: str,
                      use_activation: bool | None = None) -> tuple[list[float], int]:
    """(a score per pair, prompt tokens): a cross-encoder's activated logit of each pair read as
    one prompt, or for an embedding model the cosine of the two texts' embeddings (each
    distinct text embedded once); every prompt of the request in one submission."""
    if pooler.task == "classify":
        if pooler.num_labels != 1:
            raise bad_request(f"this classifier has {pooler.num_labels} labels; scoring needs a cross-encoder (one "
                              "label): use /classify", field)
        prompts = await ctx.offload.run(tokenize_pairs, ctx, model_path(ctx), pairs, truncate, field, large=len(pairs) > 64)
        finals = await run_pool(ctx, request, request_id, prompts, priority, field, lora)
        scores = [activate(pooler, list(o.pooled or []), use_activation)[0] for o in finals]
        return scores, sum(len(p["prompt_token_ids"]) for p in prompts)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    ids = await ctx.offload.run(tokenize_texts, ctx, texts, truncate, field, large=len(texts) > 64)
    finals = await run_pool(ctx, request, request_id, ids, priority, field, lora)
    vectors = {t: list(o.pooled or []) for t, o in zip(texts, finals)}
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(i) for i in ids)
