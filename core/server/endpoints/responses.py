"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{response_id}.

An adapter over the chat turn (`portside.server.chat_turn`) that chat completions also uses: the
input items (and, with `previous_response_id`, the stored conversation before them) become chat
messages, `instructions` a system message first, `tools` / `tool_choice` / `text.format` /
`reasoning.effort` / `max_output_tokens` the chat request's tools, tool choice, response format,
reasoning effort and output limit; the turn's reasoning, text and calls come back as `reasoning`,
`message` and `function_call` output items (`portside.server.responses_output`), streamed as the
API's typed events. Responses are kept (`store`, default true) in the server's bounded
in-memory `ResponseStore`, which `previous_response_id` continues and GET / DELETE read.
Every error names the Responses API's own field (`input[2].content[0]`, `text.format`,
`max_output_tokens`, `previous_response_id`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from portside.engine.async_engine import EngineStoppedError
from portside.outputs import CompletionOutput, RequestOutput
from portside.server.chat_turn import ChatTurn, check_top_logprobs
from portside.server.context import Route, ServingContext
from portside.server.errors import APIError, bad_request, from_validation_error
from portside.server.formatting import chat_logprobs
from portside.server.pipeline import GenerateAPI, Job, generate
from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.protocol.common import SamplingFields
from portside.server.protocol.responses import FunctionToolChoice, ResponsesRequest, chat_messages
from portside.server.response_store import StoredResponse
from portside.server.responses_output import EventStream, output_items, usage

logger = logging.getLogger(__name__)


class ResponsesSampling(SamplingFields):
    """What the pipeline reads of a Responses request, under its SamplingFields names."""

    max_output_tokens: int | None = None  # set when the request sets it: the pipeline's "explicit" limit
    max_completion_tokens: int | None = None  # the same value: a sent limit is not capped by the generation config's


def _json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _rename(e: APIError, where: list[str]) -> APIError:
    """An error of the chat request (`messages[3].content[1]`) under the Responses field that
    holds it (`input[2].content[1]`)."""
    param = e.param or ""
    m = re.match(r"messages(?:\[(\d+)\])?", param)
    if m is None:
        return e
    index = int(m.group(1)) if m.group(1) is not None else None
    new = (where[index] if index is not None and index < len(where) else "input") + param[m.end():]
    return APIError(e.status, e.message.replace(param, new, 1), param=new, code=e.code, headers=e.headers)


class Responses(GenerateAPI[ResponsesRequest]):
    name = "Responses"
    body = ResponsesRequest
    id_prefix = "resp"
    stream_end = None  # the stream ends with response.completed (or .incomplete / .failed); no [DONE]

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, large: bool) -> None:
        super().__init__(ctx, req, large)
        self.store = ctx.response_store
        self.previous = self._previous()
        try:
            self.sampling = ResponsesSampling.model_validate(self._sampling())
        except ValidationError as e:
            raise from_validation_error(e) from None
        self.where: list[str] = []  # the Responses field of each chat message
        self.conversation: list[dict[str, Any]] = []  # what this response continues: stored items, then the input
        self.conversation_bytes = 0
        self.stream: EventStream | None = None
        self.answer_tokens: Any = None  # with logprobs and --reasoning-parser: which tokens are the answer's

    def _previous(self) -> StoredResponse | None:
        rid = self.req.previous_response_id
        if rid is None:
            return None
        entry = self.store.get(rid)
        if entry is None:
            raise APIError(400, f"Previous response with id {rid!r} not found (previous_response_id): never stored "
                           f"(store: false), deleted, or evicted ({self.store.describe()})",
                           param="previous_response_id", code="previous_response_not_found")
        return entry

    def _sampling(self) -> dict[str, Any]:
        req = self.req
        out: dict[str, Any] = {"model": req.model, "stream": bool(req.stream)}
        for name in ("temperature", "top_p", "user"):
            if getattr(req, name) is not None:
                out[name] = getattr(req, name)
        if req.max_output_tokens is not None:
            out["max_output_tokens"] = out["max_completion_tokens"] = req.max_output_tokens
        fmt = req.text.format if req.text is not None else None
        if req.function_tools and (req.choice == "required" or isinstance(req.choice, FunctionToolChoice)):
            fmt = None  # the output is a call, whose arguments the tool's schema holds: text.format has no text to shape
        if fmt is not None and fmt.type == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
            out["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
        return out

    def fields(self) -> SamplingFields:
        return self.sampling

    @property
    def top_logprobs(self) -> int | None:
        return (self.req.top_logprobs or 0) if self.req.logprobs else None

    async def prepare(self) -> Job:
        ctx, req = self.ctx, self.req
        if req.logprobs:
            why = ("the model's harmony channels are not one text" if ctx.harmony else
                   "tools may be called (tool_choice is not 'none')" if req.function_tools and req.choice != "none" else None)
            if why is not None:
                name = "top_logprobs" if req.top_logprobs is not None else "include"
                raise bad_request(f"{name}: output_text logprobs are given for plain text output only; here {why}", name)
        chat = await ctx.offload.run(self._chat_request, large=True) if self.large else self._chat_request()
        self.turn = ChatTurn(ctx, chat, self.large)
        try:
            job = await self.turn.prepare(check_top_logprobs(ctx, self.top_logprobs))
        except APIError as e:
            raise _rename(e, self.where) from None
        job.prompt_param, job.max_tokens_field = "input", "max_output_tokens"
        rp = ctx.reasoning_parser
        self.answer_tokens = rp.streamer(self.turn.thinking) if rp is not None and req.logprobs else None
        return job

    def _logprobs(self, c: CompletionOutput) -> list[dict[str, Any]]:
        """The logprobs of c's tokens that are the answer's text (with --reasoning-parser, a
        reasoning streamer of its own, fed token by token, leaves out the reasoning's)."""
        entries = chat_logprobs(self.ctx, c, self.top_logprobs or 0)
        if self.answer_tokens is None:
            return entries
        return [e for e in entries if self.answer_tokens.feed(e["token"])[1]]

    def _chat_request(self) -> ChatCompletionRequest:
        """The chat request of this turn (on an offload worker when the body is large)."""
        req, prev = self.req, self.previous
        before = prev.conversation if prev is not None else []
        self.conversation = before + req.items
        self.conversation_bytes = (prev.conversation_bytes if prev is not None else 0) + _json_size(req.items)
        origins = ["previous_response_id"] * len(before) + [f"input[{i}]" for i in range(len(req.items))]
        try:
            messages, self.where = chat_messages(self.conversation, origins, req.instructions)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(":", 1)[0]) from None
        body: dict[str, Any] = {**self._sampling(), "messages": messages}
        body.pop("max_output_tokens", None)
        if req.function_tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in req.function_tools]
            choice = req.choice
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionToolChoice) else choice
            if req.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = req.parallel_tool_calls
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise _rename(from_validation_error(e), self.where) from None

    def response_id(self, job: Job) -> str:
        return job.request_id.replace(f"{self.id_prefix}-", f"{self.id_prefix}_", 1)

    def snapshot(self, job: Job, status: str, output: list[dict[str, Any]], final_usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object at `status`, echoing what the request asked for."""
        req, defaults = self.req, self.ctx.default_sampling
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        reasoning = req.reasoning
        body: dict[str, Any] = {
            "id": self.response_id(job), "object": "response", "created_at": job.created, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": req.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": req.store is not False,
            "temperature": req.temperature if req.temperature is not None else defaults.get("temperature", 1.0),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "tool_choice": {"type": "function", "name": req.choice.name} if isinstance(req.choice, FunctionToolChoice) else req.choice,
            "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                       "strict": t.strict} for t in req.function_tools],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
            "truncation": "disabled", "metadata": req.metadata or {},
        }  # fmt: skip
        if final_usage is not None:
            body["usage"] = final_usage
        if req.user is not None:
            body["user"] = req.user
        return body

    def _count_tokens(self, text: str) -> int:
        """The tokens of `text` (the reasoning's count in usage: its text tokenized again)."""
        if not text:
            return 0
        tok = self.ctx.offload.tokenizer() if self.ctx.offload.on_worker() else self.ctx.tokenizer
        return len(tok.encode(text, add_special_tokens=False))

    def _keep(self, body: dict[str, Any]) -> None:
        """Store the finished response (unless the request said store: false)."""
        if self.req.store is False:
            return
        conversation_bytes = self.conversation_bytes + _json_size(body["output"])
        entry = StoredResponse(body, self.conversation + body["output"], conversation_bytes,
                               conversation_bytes + _json_size(body))
        if not self.store.put(body["id"], entry):
            logger.warning("response %s (%d bytes) not stored: over --responses-store-max-bytes", body["id"], entry.nbytes)

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        (c,) = out.outputs
        parsed = self.turn.parse(c)
        incomplete = c.finish_reason == "length"
        logprobs = self._logprobs(c) if self.req.logprobs else None
        use = usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens, self._count_tokens(parsed.reasoning or ""))
        body = self.snapshot(job, "incomplete" if incomplete else "completed", output_items(parsed, incomplete, logprobs), use)
        self._keep(body)
        return body

    async def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        self.stream = stream = EventStream(lambda *a: self.snapshot(job, *a))
        for event in stream.start():
            yield event
        parsers = self.turn.stream()
        output_tokens = cached = 0
        pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is still held back
        incomplete = False
        async for _, out in outputs:
            (c,) = out.outputs
            output_tokens += len(c.token_ids)
            final = c.finish_reason is not None
            if self.req.logprobs:
                pending += self._logprobs(c)
            deltas = parsers.deltas(c.text, final=final, token_ids=c.token_ids)
            if final:
                incomplete, cached = c.finish_reason == "length", out.num_cached_tokens
                if pending and not any("content" in d for d in deltas):
                    deltas.append({"content": ""})
            for delta in deltas:
                taken, pending = (pending, []) if "content" in delta else ([], pending)
                for event in stream.feed(delta, taken):
                    yield event
        reasoning = "".join(i["content"][0]["text"] for i in stream.items if i["type"] == "reasoning")
        n_reasoning = await self.ctx.offload.run(self._count_tokens, reasoning, large=False, refusable=False) if reasoning else 0
        closing, body = stream.finish(incomplete, usage(len(job.prompt_ids()[0]), output_tokens, cached, n_reasoning))
        self._keep(body)
        for event in closing:
            yield event

    def sse(self, payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def error_event(self, e: BaseException) -> str:
        """`response.failed` with the error (a failure after the stream started)."""
        if isinstance(e, APIError):
            code = "rate_limit_exceeded" if e.status == 429 else "server_error" if e.status >= 500 else "invalid_prompt"
            message = e.message
        elif isinstance(e, EngineStoppedError):
            code, message = "server_error", str(e)
        else:
            logger.exception("error while streaming a response", exc_info=e)
            code, message = "server_error", "internal server error; see the server log"
        if self.stream is None:
            return self.sse({"type": "error", "sequence_number": 0, "code": code, "message": message, "param": None})
        return self.sse(self.stream.failed(code, message))


async def create(ctx: ServingContext, request: Request) -> Response:
    """POST /v1/responses: the pipeline, its errors under the Responses API's field names."""
    try:
        return await generate(Responses, ctx, request)
    except APIError as e:
        if e.param is not None and e.param.startswith("response_format"):
            raise APIError(e.status, e.message.replace("response_format", "text.format", 1), param="text.format", code=e.code,
                           headers=e.headers) from None
        raise


def _not_found(response_id: str, store: Any) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found (never stored, stored with store: false, deleted, or "
                    f"evicted: {store.describe()})", param="response_id", code="not_found")


def _no_query(request: Request) -> None:
    """A 400 naming the first query parameter: these routes take none (`stream`, `starting_after`,
    `include`: a stored response is returned whole, never re-streamed)."""
    name = next(iter(request.query_params), None)
    if name is not None:
        raise bad_request(f"{name}: not supported by portside on this route (a stored response is returned whole, "
                          "never re-streamed)", name)


async def retrieve(ctx: ServingContext, request: Request) -> Response:
    """GET /v1/responses/{response_id}: the stored response."""
    response_id = request.path_params["response_id"]
    _no_query(request)
    entry = ctx.response_store.get(response_id)
    if entry is None:
        raise _not_found(response_id, ctx.response_store)
    return JSONResponse(entry.body)


async def delete(ctx: ServingContext, request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget it."""
    response_id = request.path_params["response_id"]
    _no_query(request)
    if not ctx.response_store.delete(response_id):
        raise _not_found(response_id, ctx.response_store)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


ROUTES = (
    Route("POST", "/v1/responses", create, counted=True),
    Route("GET", "/v1/responses/{response_id}", retrieve),
    Route("DELETE", "/v1/responses/{response_id}", delete),
)
