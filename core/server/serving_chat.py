"""POST /v1/chat/completions: messages through the model's chat template, streamed or not, with
structured output, tool calls (`portside.server.tools`) and reasoning split from the answer
(`--reasoning-parser`).

Images (`image_url` content parts, vision-language models): the template renders an image
placeholder per image part; the images are loaded by the server's `MediaConnector` (downloads
awaited, decoding in worker threads) and processed by the engine's `process_multimodal` (in a
worker thread too) before the request is added, so a bad image is a 400 and the engine never sees
the request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from portside.chat_template import render_chat
from portside.outputs import CompletionOutput, RequestOutput
from portside.server.beam_search import beam_search
from portside.server.errors import APIError, bad_request
from portside.server.protocol import ChatCompletionRequest
from portside.server.serving_base import (
    SSE_DONE,
    ChoiceCursor,
    EngineStreamingResponse,
    ResponseBuilder,
    ServingContext,
    chat_logprobs,
    collect,
    json_response,
    merged,
    new_id,
    openai_finish_reason,
    parse_body,
    prompt_logprobs_json,
    resolve_max_tokens,
    response_values,
    sampling_params,
    sse,
    stream_error,
    submit_all,
    until_disconnected,
    usage,
)
from portside.server.tools import ToolPlan, ToolStream, parse_output, plan_tools, template_messages

# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})  # fmt: skip
REQUEST_TEMPLATE_BUDGET_S = 2.0  # render time a template sent with a request may take
REQUEST_TEMPLATE_MAX_CHARS = 8 << 20  # and the most text it may render


def check_template_fields(ctx: ServingContext, req: Any) -> None:
    """The 400s for a request's own template (`chat_template`) and its variables
    (`chat_template_kwargs`): chat completions and every endpoint that renders messages."""
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request("chat_template: this server does not render templates sent with a request; its operator "
                          "can allow them with --trust-request-chat-template", "chat_template")
    bad = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(req.chat_template_kwargs or {}))
    if bad:
        raise bad_request(f"chat_template_kwargs: {bad[0]!r} is a parameter of the template call itself, not a "
                          "template variable", "chat_template_kwargs")


async def create_chat_completion(ctx: ServingContext, request: Request) -> Any:
    req, large = await parse_body(ctx, request, ChatCompletionRequest)
    lora = ctx.check_model(req.model)
    check_template_fields(ctx, req)
    images = _image_parts(req)
    if images:
        _check_images(ctx, req, images)
    plan = plan_tools(req, ctx.tool_parser, ctx.tokenizer)
    text, prompt_ids = await ctx.offload.run(_render, ctx, req, plan, bool(images), large=large or req.chat_template is not None)
    prompt: list[int] | dict[str, Any] = prompt_ids
    if images:  # loaded and processed before anything reaches the engine: a bad image adds no request
        prompt = await _image_prompt(ctx, text, prompt_ids, images)
        prompt_ids = prompt["prompt_token_ids"]
    requested, field_name = req.requested_max_tokens
    max_tokens = resolve_max_tokens(requested, field_name, True, len(prompt_ids), ctx.max_model_len, "messages")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    if top_k is not None and 0 <= ctx.max_logprobs < top_k:
        raise bad_request(f"top_logprobs: {top_k} requested, more than the {ctx.max_logprobs} this server allows "
                          "(--max-logprobs); ask for fewer", "top_logprobs")
    structured = await ctx.constraint(req, plan.constraint)
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top_k, renames={"max_tokens": field_name},
                             structured=structured, skip_special_tokens=plan.skip_special_tokens, defaults=ctx.default_sampling)
    request_id = new_id("chatcmpl")
    created = int(time.time())
    thinking = ctx.reasoning_parser is not None and bool(ctx.reasoning_parser.prompt_opens_reasoning(prompt_ids))
    if req.use_beam_search:
        features = [prompt["mm_features"]] if isinstance(prompt, dict) else None
        (final,) = await beam_search(ctx, request, request_id, [prompt_ids], [max_tokens], req, lora, "messages", features)
    else:
        streams = await submit_all(ctx, request_id, [prompt], [params], req.priority, "messages", lora)  # type: ignore[list-item]
        if req.stream:
            body = _stream(ctx, req, plan, thinking, request_id, created, merged(streams), len(prompt_ids))
            return EngineStreamingResponse(body, streams)
        (final,) = await until_disconnected(request, collect(merged(streams), 1))
    build, values = ResponseBuilder(_response, ctx, req, plan, thinking, request_id, created, final, outputs=[final]), response_values([final])
    del final  # build holds the only reference: a large output is freed off the loop
    return await json_response(ctx, build, values)


def _image_parts(req: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(parameter, URL) of every image of the conversation, in order: messages[i].content[j]."""
    out = []
    for i, m in enumerate(req.messages):
        urls = iter(m.image_urls)
        if isinstance(m.content, list):
            out += [(f"messages[{i}].content[{j}]", next(urls)) for j, p in enumerate(m.content) if p.get("type") == "image"]
    return out


def supports_images(ctx: ServingContext) -> bool:
    """Whether the served model takes images (a vision-language model)."""
    value = getattr(ctx.engine, "supports_images", None)
    if value is None:
        value = getattr(getattr(ctx.engine, "engine", None), "supports_images", False)
    return bool(value)


def _image_limit(ctx: ServingContext) -> int | None:
    """--limit-mm-per-prompt's image count (None: unknown here; the engine checks it)."""
    config = getattr(getattr(ctx.engine, "engine", None), "config", None)
    multimodal = getattr(config, "multimodal", None)
    return multimodal.limit("image") if multimodal is not None else None


def _check_images(ctx: ServingContext, req: ChatCompletionRequest, images: list[tuple[str, str]]) -> None:
    """The 400s an image request gets before any image is read."""
    if not supports_images(ctx):  # about the message, not one image: the param names its content
        where = images[0][0].rsplit("[", 1)[0]
        raise bad_request(f"{where}: model {req.model!r} does not take images: it is a text-only model; send text content "
                          "only (image parts need a vision-language model)", where)
    limit = _image_limit(ctx)
    if limit is not None and len(images) > limit:
        raise bad_request(f"{images[limit][0]}: {len(images)} images in one request, more than the {limit} this server allows per prompt "
                          "(its operator can raise it with --limit-mm-per-prompt '{\"image\": N}')", images[limit][0])


async def _image_prompt(ctx: ServingContext, text: str, ids: list[int], images: list[tuple[str, str]]) -> dict[str, Any]:
    """The engine's processed prompt for the rendered conversation and its images. Reading and
    decoding happen in worker threads (`MediaConnector.load_images`), processing too
    (`process_multimodal`); every failure is a 400 naming the image."""
    from portside.multimodal.media import ImageLoadError

    try:
        loaded = await ctx.media.load_images([url for _, url in images])
    except ImageLoadError as e:
        raise bad_request(f"{images[e.index][0]}: the image could not be loaded: {e.reason}", images[e.index][0]) from None
    process = getattr(ctx.engine, "process_multimodal", None)
    if process is None:
        raise APIError(501, "this server's engine cannot process images", param=images[0][0], code="not_implemented")
    try:
        return await process({"prompt": text, "prompt_token_ids": ids, "multi_modal_data": {"image": loaded}},
                             add_special_tokens=False)
    except ValueError as e:  # too many images, a model without images, a processor's refusal
        raise bad_request(f"messages: {e}", "messages") from None
    finally:
        del loaded


def _render(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, images: bool = False) -> tuple[str, list[int]]:
    """The prompt's text and token ids through the chat template (on an offload worker). Special
    tokens written in user and tool messages are plain text: a user cannot forge a turn."""
    template = req.chat_template or ctx.chat_template
    tok = ctx.offload.tokenizer()
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template", "messages")
    untrusted = req.chat_template is not None
    try:
        return render_chat(
            tok, template_messages(req), chat_template=template, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs,
            budget_s=REQUEST_TEMPLATE_BUDGET_S if untrusted else None, max_chars=REQUEST_TEMPLATE_MAX_CHARS if untrusted else None,
            supports_images=supports_images(ctx) if images else None, model_name=req.model,
        )  # fmt: skip
    except Exception as e:  # template errors (e.g. a template that enforces role order) are the request's fault
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None


def _role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """The reply's role: --response-role (default "assistant") when the template added the
    generation prompt, as vLLM does; "assistant" when the request continues its last message."""
    return ctx.response_role if req.add_generation_prompt else "assistant"


def _finish_reason(c: CompletionOutput, plan: ToolPlan, called: bool) -> str | None:
    reason = openai_finish_reason(c.finish_reason)
    if reason == "stop" and called and plan.choice in ("auto", "required"):
        return "tool_calls"  # a named function's call ends with "stop", as OpenAI's does
    return reason


def _response(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, thinking: bool, request_id: str,
              created: int, out: RequestOutput) -> dict[str, Any]:
    choices = []
    k = req.top_logprobs or 0
    for c in out.outputs:
        logprobs = {"content": chat_logprobs(ctx, c, k), "refusal": None} if req.logprobs else None
        reasoning, text = (None, c.text)
        if ctx.reasoning_parser is not None:
            reasoning, text = ctx.reasoning_parser.extract(c.text, thinking)
        content, calls = parse_output(plan, text or "")
        message: dict[str, Any] = {"role": _role(ctx, req), "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if ctx.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(c, plan, bool(calls))})
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        # best_of > n: the samples not returned count too
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs) + out.num_dropped_tokens,
                       out.num_cached_tokens),
    }
    if req.prompt_logprobs is not None:  # vLLM's extra field: the rendered prompt's, on the response
        body["prompt_logprobs"] = prompt_logprobs_json(ctx, out.prompt_logprobs)
    return body


@dataclass
class _ChoiceStream:
    """One streamed choice: what was sent, and the reasoning / tool-call parsers of its text."""

    cursor: ChoiceCursor
    tools: ToolStream
    reasoning: Any = None  # a ReasoningStreamer, with --reasoning-parser

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """OpenAI `delta` dicts for new text (and, when `final`, whatever the parsers held back)."""
        out: list[dict[str, Any]] = []
        if self.reasoning is None:
            answer = text
        else:
            r, answer = self.reasoning.feed(text) if text else ("", "")
            if final:
                r2, a2 = self.reasoning.finish()
                r, answer = r + r2, answer + a2
            if r:
                out.append({"reasoning_content": r})
        out += self.tools.feed(answer)
        if final:
            out += self.tools.finish()
        return out


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    thinking: bool,
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

    rp = ctx.reasoning_parser
    choices = [_ChoiceStream(ChoiceCursor(), ToolStream(plan), rp.streamer(thinking) if rp is not None else None) for _ in range(req.n)]
    completion_tokens = cached = 0
    try:
        # the role comes first, before any token, as OpenAI's stream does
        for i in range(req.n):
            yield chunk({"index": i, "delta": {"role": _role(ctx, req), "content": ""}, "logprobs": None, "finish_reason": None})
        async for _, out in outputs:
            for c in out.outputs:
                ch = choices[c.index]
                cur = ch.cursor
                if cur.finished:
                    continue
                cur.advance(c)
                finish = openai_finish_reason(c.finish_reason)
                if not (c.text or c.token_ids or finish):
                    continue
                logprobs = {"content": chat_logprobs(ctx, c, k), "refusal": None} if req.logprobs else None
                deltas = ch.deltas(c.text, final=finish is not None)
                if finish:
                    cur.finished = True
                    completion_tokens += cur.num_tokens
                    finish = _finish_reason(c, plan, ch.tools.called)
                if not deltas:  # tokens whose text is held back (a partial character, a parser's buffer)
                    deltas = [{} if finish else {"content": ""}]
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                                 "finish_reason": finish if last else None})
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
