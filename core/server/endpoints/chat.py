"""POST /v1/chat/completions: messages through the model's chat template (`portside.server.rendering`,
images included), streamed or not, with structured output, tool calls (`portside.server.tools`)
and reasoning split from the answer (`--reasoning-parser`). The stages every generate endpoint
shares are `portside.server.pipeline`'s; this module is the adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from portside.outputs import CompletionOutput, RequestOutput
from portside.server.errors import bad_request
from portside.server.formatting import ChoiceCursor, chat_logprobs, openai_finish_reason, prompt_logprobs_json, usage
from portside.server.harmony import encoding_or_503
from portside.server.harmony_output import HarmonyStream
from portside.server.harmony_plan import prepare_harmony
from portside.server.pipeline import GenerateAPI, Job, generate_route
from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.rendering import check_images, check_template_fields, image_parts, image_prompt, render
from portside.server.streams import Prompt
from portside.server.tools import ToolPlan, ToolStream, parse_output, plan_tools


class ChatCompletions(GenerateAPI[ChatCompletionRequest]):
    name = "Chat Completions"
    body = ChatCompletionRequest
    id_prefix = "chatcmpl"
    plan: ToolPlan
    prefill: list[int]  # harmony: the prompt's tokens after <|start|>assistant, where its output parser starts
    thinking: bool  # the rendered prompt opens a reasoning block (--reasoning-parser)

    async def prepare(self) -> Job:
        ctx, req = self.ctx, self.req
        if ctx.harmony:  # gpt-oss: harmony renders the prompt, and its parser reads the output
            self.plan, self.prefill, job = await prepare_harmony(ctx, req, self.large, self._top_logprobs())
            self.thinking = False
            return job
        check_template_fields(ctx, req)
        images = image_parts(req.messages)
        if images:
            check_images(ctx, req.model, images)
        self.plan = plan = plan_tools(req, ctx.tool_parser, ctx.tokenizer)
        text, ids = await ctx.offload.run(render, ctx, req, plan.tools, bool(images),
                                          large=self.large or req.chat_template is not None)
        prompt: Prompt = ids
        if images:  # loaded and processed before anything reaches the engine: a bad image adds no request
            prompt = await image_prompt(ctx, text, ids, images)
            ids = prompt["prompt_token_ids"]
        top_k = self._top_logprobs()
        self.thinking = ctx.reasoning_parser is not None and bool(ctx.reasoning_parser.prompt_opens_reasoning(ids))
        requested, field_name = req.requested_max_tokens
        return Job([prompt], "messages", requested, field_name, logprobs=top_k, constraint=plan.constraint,
                   skip_special_tokens=plan.skip_special_tokens)

    def _top_logprobs(self) -> int | None:
        top_k = (self.req.top_logprobs or 0) if self.req.logprobs else None
        if top_k is not None and 0 <= self.ctx.max_logprobs < top_k:
            raise bad_request(f"top_logprobs: {top_k} requested, more than the {self.ctx.max_logprobs} this server allows "
                              "(--max-logprobs); ask for fewer", "top_logprobs")
        return top_k

    def _harmony(self) -> HarmonyStream:
        """A parser of one choice's harmony output (it starts inside the prompt's prefill)."""
        return HarmonyStream(encoding_or_503(), self.prefill, calls_allowed=self.plan.choice != "none", parallel=self.plan.parallel)

    def role(self) -> str:
        """The reply's role: --response-role (default "assistant") when the template added the
        generation prompt, as vLLM does; "assistant" when the request continues its last message."""
        return self.ctx.response_role if self.req.add_generation_prompt else "assistant"

    def finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        reason = openai_finish_reason(c.finish_reason)
        if reason == "stop" and called and self.plan.choice in ("auto", "required"):
            return "tool_calls"  # a named function's call ends with "stop", as OpenAI's does
        return reason

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        body = {
            "id": job.request_id,
            "object": "chat.completion",
            "created": job.created,
            "model": self.req.model,
            "choices": [self._choice(c) for c in out.outputs],
            # best_of > n: the samples not returned count too
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs) + out.num_dropped_tokens,
                           out.num_cached_tokens),
        }
        if self.req.prompt_logprobs is not None:  # vLLM's extra field: the rendered prompt's, on the response
            body["prompt_logprobs"] = prompt_logprobs_json(self.ctx, out.prompt_logprobs)
        return body

    def _choice(self, c: CompletionOutput) -> dict[str, Any]:
        ctx, req = self.ctx, self.req
        logprobs = {"content": chat_logprobs(ctx, c, req.top_logprobs or 0), "refusal": None} if req.logprobs else None
        reasoning, text = (None, c.text)
        if ctx.harmony:
            parsed = self._harmony().parse_all(c.token_ids)
            reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
        else:
            if ctx.reasoning_parser is not None:
                reasoning, text = ctx.reasoning_parser.extract(c.text, self.thinking)
            content, calls = parse_output(self.plan, text or "")
        message: dict[str, Any] = {"role": self.role(), "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if ctx.reasoning_parser is not None or ctx.harmony:
            message["reasoning_content"] = reasoning
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason(c, bool(calls))}

    async def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        req = self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        rp = self.ctx.reasoning_parser
        choices = [_ChoiceStream(ChoiceCursor(), ToolStream(self.plan), rp.streamer(self.thinking) if rp is not None else None,
                                 self._harmony() if self.ctx.harmony else None) for _ in range(req.n)]
        completion_tokens = cached = 0
        # the role comes first, before any token, as OpenAI's stream does
        for i in range(req.n):
            yield self._chunk(job, {"index": i, "delta": {"role": self.role(), "content": ""}, "logprobs": None,
                                    "finish_reason": None}, include_usage)
        async for _, out in outputs:
            for c in out.outputs:
                ch = choices[c.index]
                was_finished = ch.cursor.finished
                for choice in self._deltas(ch, c):
                    yield self._chunk(job, choice, include_usage)
                if ch.cursor.finished and not was_finished:
                    completion_tokens += ch.cursor.num_tokens
            if out.finished:
                cached = out.num_cached_tokens
        if include_usage:
            yield {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created, "model": req.model,
                   "choices": [], "usage": usage(len(job.prompt_ids()[0]), completion_tokens, cached)}

    def _chunk(self, job: Job, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
                                "model": self.req.model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def _deltas(self, ch: _ChoiceStream, c: CompletionOutput) -> list[dict[str, Any]]:
        """The `choices` entries of one choice's new output (none when it has nothing to send)."""
        cur = ch.cursor
        if cur.finished:
            return []
        cur.advance(c)
        finish = openai_finish_reason(c.finish_reason)
        if not (c.text or c.token_ids or finish):
            return []
        logprobs = {"content": chat_logprobs(self.ctx, c, self.req.top_logprobs or 0), "refusal": None} if self.req.logprobs else None
        deltas = ch.deltas(c.text, final=finish is not None, token_ids=c.token_ids)
        if finish:
            cur.finished = True
            finish = self.finish_reason(c, ch.called)
        if not deltas:  # tokens whose text is held back (a partial character, a parser's buffer)
            deltas = [{} if finish else {"content": ""}]
        last = len(deltas) - 1
        return [{"index": c.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                 "finish_reason": finish if j == last else None} for j, delta in enumerate(deltas)]


@dataclass
class _ChoiceStream:
    """One streamed choice: what was sent, and the reasoning / tool-call parsers of its text."""

    cursor: ChoiceCursor
    tools: ToolStream
    reasoning: Any = None  # a ReasoningStreamer, with --reasoning-parser
    harmony: HarmonyStream | None = None  # a harmony model's parser (it reads tokens, not text)

    @property
    def called(self) -> bool:
        return self.harmony.called if self.harmony is not None else self.tools.called

    def deltas(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """OpenAI `delta` dicts for new text (and, when `final`, whatever the parsers held back)."""
        if self.harmony is not None:
            return self.harmony.feed(list(token_ids)) + (self.harmony.finish() if final else [])
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


ROUTES = (generate_route("/v1/chat/completions", ChatCompletions),)
