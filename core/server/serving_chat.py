"""POST /v1/chat/completions: messages through the model's chat template, streamed or not, with
structured output, tool calls (`portside.server.tools`) and reasoning split from the answer
(`--reasoning-parser`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from portside.outputs import CompletionOutput, RequestOutput
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
from portside.server.tools import ToolPlan, ToolStream, parse_output, plan_tools, template_messages


async def create_chat_completion(ctx: ServingContext, request: Request) -> Any:
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    plan = plan_tools(req, ctx.tool_parser, ctx.tokenizer)
    prompt_ids = _render(ctx, req, plan)
    requested, field_name = req.requested_max_tokens
    max_tokens = resolve_max_tokens(requested, field_name, True, len(prompt_ids), ctx.max_model_len, "messages")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    structured = await ctx.constraint(req, plan.constraint)
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top_k, renames={"max_tokens": field_name},
                             structured=structured, skip_special_tokens=plan.skip_special_tokens)
    request_id = new_id("chatcmpl")
    streams = await submit_all(ctx, request_id, [prompt_ids], [params], req.priority, "messages")
    created = int(time.time())
    thinking = ctx.reasoning_parser is not None and bool(ctx.reasoning_parser.prompt_opens_reasoning(prompt_ids))
    if req.stream:
        body = _stream(ctx, req, plan, thinking, request_id, created, merged(streams), len(prompt_ids))
        return EngineStreamingResponse(body, streams)
    (final,) = await until_disconnected(request, collect(merged(streams), 1))
    return JSONResponse(_response(ctx, req, plan, thinking, request_id, created, final))


def _render(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    """Apply the chat template; the rendered text already holds its special tokens."""
    template = req.chat_template or ctx.chat_template
    if template is None and not getattr(ctx.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template", "messages")
    try:
        text = ctx.tokenizer.apply_chat_template(
            template_messages(req), tools=plan.tools, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=template, **(req.chat_template_kwargs or {}),
        )  # fmt: skip
    except Exception as e:  # template errors (e.g. a template that enforces role order) are the request's fault
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    return ctx.tokenizer(text, add_special_tokens=False).input_ids


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
        logprobs = {"content": chat_logprobs(ctx, c, 0, k), "refusal": None} if req.logprobs else None
        reasoning, text = (None, c.text)
        if ctx.reasoning_parser is not None:
            reasoning, text = ctx.reasoning_parser.extract(c.text, thinking)
        content, calls = parse_output(plan, text or "")
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if ctx.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(c, plan, bool(calls))})
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
    }


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
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        async for _, out in outputs:
            for c in out.outputs:
                ch = choices[c.index]
                cur = ch.cursor
                if cur.finished:
                    continue
                text, tokens, start = cur.delta(c)
                finish = openai_finish_reason(c.finish_reason)
                if not (text or tokens or finish):
                    continue
                logprobs = {"content": chat_logprobs(ctx, c, start, k), "refusal": None} if req.logprobs else None
                deltas = ch.deltas(text, final=finish is not None)
                if finish:
                    cur.finished = True
                    completion_tokens += len(c.token_ids)
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
