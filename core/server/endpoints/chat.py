"""POST /v1/chat/completions: messages through the model's chat template (`portside.server.rendering`,
images included), streamed or not, with structured output, tool calls (`portside.server.tools`)
and reasoning split from the answer (`--reasoning-parser`). The stages every generate endpoint
shares are `portside.server.pipeline`'s, the conversation's `portside.server.chat_turn`'s; this
module is the adapter of OpenAI's chat shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from portside.outputs import CompletionOutput, RequestOutput
from portside.server.chat_turn import ChatTurn, TurnStream, check_top_logprobs
from portside.server.formatting import ChoiceCursor, chat_logprobs, openai_finish_reason, prompt_logprobs_json, usage
from portside.server.pipeline import GenerateAPI, Job, generate_route
from portside.server.protocol.bodies import ChatCompletionRequest


class ChatCompletions(GenerateAPI[ChatCompletionRequest]):
    name = "Chat Completions"
    body = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def __init__(self, ctx: Any, req: ChatCompletionRequest, large: bool) -> None:
        super().__init__(ctx, req, large)
        self.turn = ChatTurn(ctx, req, large)

    async def prepare(self) -> Job:
        top_k = (self.req.top_logprobs or 0) if self.req.logprobs else None
        return await self.turn.prepare(check_top_logprobs(self.ctx, top_k))

    def role(self) -> str:
        """The reply's role: --response-role (default "assistant") when the template added the
        generation prompt, as vLLM does; "assistant" when the request continues its last message."""
        return self.ctx.response_role if self.req.add_generation_prompt else "assistant"

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
        parsed = self.turn.parse(c)
        reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
        message: dict[str, Any] = {"role": self.role(), "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if self.turn.splits_reasoning:
            message["reasoning_content"] = reasoning
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": self.turn.finish_reason(c, bool(calls))}

    async def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        req = self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        choices = [(ChoiceCursor(), self.turn.stream()) for _ in range(req.n)]
        completion_tokens = cached = 0
        # the role comes first, before any token, as OpenAI's stream does
        for i in range(req.n):
            yield self._chunk(job, {"index": i, "delta": {"role": self.role(), "content": ""}, "logprobs": None,
                                    "finish_reason": None}, include_usage)
        async for _, out in outputs:
            for c in out.outputs:
                cur, parsers = choices[c.index]
                was_finished = cur.finished
                for choice in self._deltas(cur, parsers, c):
                    yield self._chunk(job, choice, include_usage)
                if cur.finished and not was_finished:
                    completion_tokens += cur.num_tokens
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

    def _deltas(self, cur: ChoiceCursor, parsers: TurnStream, c: CompletionOutput) -> list[dict[str, Any]]:
        """The `choices` entries of one choice's new output (none when it has nothing to send)."""
        if cur.finished:
            return []
        cur.advance(c)
        finish = openai_finish_reason(c.finish_reason)
        if not (c.text or c.token_ids or finish):
            return []
        logprobs = {"content": chat_logprobs(self.ctx, c, self.req.top_logprobs or 0), "refusal": None} if self.req.logprobs else None
        deltas = parsers.deltas(c.text, final=finish is not None, token_ids=c.token_ids)
        if finish:
            cur.finished = True
            finish = self.turn.finish_reason(c, parsers.called)
        if not deltas:  # tokens whose text is held back (a partial character, a parser's buffer)
            deltas = [{} if finish else {"content": ""}]
        last = len(deltas) - 1
        return [{"index": c.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                 "finish_reason": finish if j == last else None} for j, delta in enumerate(deltas)]


ROUTES = (generate_route("/v1/chat/completions", ChatCompletions),)
