"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from portside.outputs import RequestOutput
from portside.server.errors import bad_request
from portside.server.protocol import ChatCompletionRequest
from portside.server.serving_base import (
    SSE_DONE,
    ChoiceCursor,
    EngineStreamingResponse,
    ServingContext,
    chat_logprobs,
    collect,
    merged,
    new_id,
    openai_finish_reason,
    parse_body,
    resolve_max_tokens,
    sampling_params,
    sse,
    stream_error,
    submit_all,
    until_disconnected,
    usage,
)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Any:
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    prompt_ids = _render(ctx, req)
    requested, field_name = req.requested_max_tokens
    max_tokens = resolve_max_tokens(requested, field_name, True, len(prompt_ids), ctx.max_model_len, "messages")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top_k, renames={"max_tokens": field_name})
    request_id = new_id("chatcmpl")
    streams = await submit_all(ctx, request_id, [prompt_ids], [params], req.priority, "messages")
    created = int(time.time())
    if req.stream:
        return EngineStreamingResponse(_stream(ctx, req, request_id, created, merged(streams), len(prompt_ids)), streams)
    (final,) = await until_disconnected(request, collect(merged(streams), 1))
    return JSONResponse(_response(ctx, req, request_id, created, final))


def _render(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    """Apply the chat template; the rendered text already holds its special tokens."""
    messages = [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {}) for m in req.messages]
    template = req.chat_template or ctx.chat_template
    if template is None and not getattr(ctx.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template", "messages")
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt, chat_template=template
        )
    except Exception as e:  # template errors (e.g. a template that enforces role order) are the request's fault
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    return ctx.tokenizer(text, add_special_tokens=False).input_ids


def _response(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, created: int, out: RequestOutput) -> dict[str, Any]:
    choices = []
    k = req.top_logprobs or 0
    for c in out.outputs:
        logprobs = {"content": chat_logprobs(ctx, c, 0, k), "refusal": None} if req.logprobs else None
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": openai_finish_reason(c.finish_reason),
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
    }


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    created: int,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    k = req.top_logprobs or 0

    def chunk(choice: dict[str, Any]) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    cursors = [ChoiceCursor() for _ in range(req.n)]
    completion_tokens = cached = 0
    try:
        # the role comes first, before any token, as OpenAI's stream does
        for i in range(req.n):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        async for _, out in outputs:
            for c in out.outputs:
                cur = cursors[c.index]
                if cur.finished:
                    continue
                text, tokens, start = cur.delta(c)
                finish = openai_finish_reason(c.finish_reason)
                if not (text or tokens or finish):
                    continue
                logprobs = {"content": chat_logprobs(ctx, c, start, k), "refusal": None} if req.logprobs else None
                if finish:
                    cur.finished = True
                    completion_tokens += len(c.token_ids)
                delta = {"content": text} if text or not finish else {}
                yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            if out.finished:
                cached = out.num_cached_tokens
        if include_usage:
            yield sse(
                {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model, "choices": [],
                 "usage": usage(prompt_tokens, completion_tokens, cached)}
            )  # fmt: skip
    except Exception as e:
        yield stream_error(e)
    yield SSE_DONE
