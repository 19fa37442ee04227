"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens: an adapter
of Anthropic's shapes over the shared chat turn (`portside.server.chat_turn`), as chat
completions is of OpenAI's.

The body (`portside.server.protocol.anthropic`) becomes a chat-completions request: the system
prompt, turns with text, images, tool_use / tool_result and thinking blocks, tools, tool_choice
(auto, any -> required, tool -> a named function, none), `thinking` as the template's
enable_thinking. The turn's reading of the output becomes content blocks (thinking, text,
tool_use) with Anthropic's stop_reason and usage, or, streamed, Anthropic's events
(message_start, ping, content_block_start / _delta / _stop per block, message_delta,
message_stop; `event: error` for a failure after the first byte). Errors on these paths take
Anthropic's shape (`portside.server.errors.error_response`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from portside.engine.async_engine import EngineStoppedError
from portside.outputs import CompletionOutput, RequestOutput
from portside.server.chat_turn import ChatTurn
from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import APIError, bad_request, from_validation_error
from portside.server.pipeline import GenerateAPI, Job, generate_route
from portside.server.protocol.anthropic import (
    ConversationBody,
    CountTokensBody,
    MessagesBody,
    Origin,
    anthropic_param,
    chat_messages,
    chat_tool_choice,
    chat_tools,
)
from portside.server.protocol.bodies import ChatCompletionRequest

logger = logging.getLogger(__name__)

API_NAME = "Messages"


def chat_request(ctx: ServingContext, body: ConversationBody, count_only: bool = False) -> tuple[ChatCompletionRequest, list[Origin]]:
    """The chat-completions request of an Anthropic body and where its messages came from; a 400
    (naming Anthropic's field) for what this server cannot honour. `count_only`: render only
    (count_tokens), so tool_choice does not matter (the template shows the tools either way)."""
    choice, parallel = chat_tool_choice(body)
    if count_only:
        choice = "none" if body.tools else None
    elif choice == "auto" and ctx.tool_parser is None and not ctx.harmony:
        raise bad_request("tool_choice: the model's own tool calls (tool_choice 'auto', the default with tools) need the "
                          "server started with --enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice "
                          "{'type': 'any'} or {'type': 'tool', 'name': ...} (constrained by the grammar engine), or 'none'",
                          "tool_choice")
    prefill = body.messages[-1].role == "assistant"  # the reply continues the final assistant message
    messages, origins = chat_messages(body)
    data: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": chat_tools(body), "tool_choice": choice,
        "parallel_tool_calls": parallel, "add_generation_prompt": not prefill, "continue_final_message": prefill,
    }  # fmt: skip
    kwargs = _thinking_kwargs(ctx, body)
    if kwargs:
        data["chat_template_kwargs"] = kwargs
    if isinstance(body, MessagesBody):
        data |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "stream": body.stream,
                 "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                 "user": body.metadata.user_id if body.metadata is not None else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None}), origins
    except ValidationError as e:  # the Anthropic body was checked first: this is a mapping the chat body refuses
        raise renamed(from_validation_error(e), origins) from None


def renamed(e: APIError, origins: list[Origin]) -> APIError:
    """`e` naming the messages of the Anthropic body where it names the chat request's."""
    e.message = anthropic_param(e.message, origins)
    e.param = anthropic_param(e.param, origins) if e.param else e.param
    e.args = (e.message,)
    return e


async def prepare_turn(turn: ChatTurn, origins: list[Origin]) -> Job:
    """The turn's job (rendering, images), its errors naming the Anthropic body's messages."""
    try:
        return await turn.prepare()
    except APIError as e:
        raise renamed(e, origins) from None


def _thinking_kwargs(ctx: ServingContext, body: ConversationBody) -> dict[str, Any] | None:
    """What `thinking` asks of the chat template: enable_thinking (Qwen3's variable) and thinking
    (DeepSeek-V3.1's, Granite's), or nothing for the template's default."""
    thinking = body.thinking
    if thinking is None or thinking.type == "adaptive":
        return None
    enabled = thinking.type == "enabled"
    if ctx.harmony:  # gpt-oss always reasons (its analysis channel)
        if not enabled:
            raise bad_request("thinking: a gpt-oss (harmony) model always reasons; leave thinking out or enable it",
                              "thinking")
        return None
    if enabled and ctx.reasoning_parser is None:
        raise bad_request("thinking: this server does not split the model's reasoning from its answer; start it with "
                          "--reasoning-parser NAME (deepseek_r1, qwen3, ...) to get thinking blocks", "thinking")
    return {"enable_thinking": enabled, "thinking": enabled}


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (portside verifies none it is sent back)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache (their
    sum with cache_read_input_tokens is the prompt); the cache is automatic, so nothing counts as
    written by a cache_control breakpoint."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "service_tier": "standard"}


class Messages(GenerateAPI[MessagesBody]):
    name = API_NAME
    body = MessagesBody
    id_prefix = "msg"
    stream_end = None  # Anthropic's stream ends with message_stop, no [DONE]

    def __init__(self, ctx: ServingContext, req: MessagesBody, large: bool) -> None:
        super().__init__(ctx, req, large)
        self.chat, self.origins = chat_request(ctx, req)
        self.turn = ChatTurn(ctx, self.chat, large)

    def fields(self) -> ChatCompletionRequest:
        return self.chat

    async def prepare(self) -> Job:
        return await prepare_turn(self.turn, self.origins)

    @property
    def omit_thinking(self) -> bool:
        return self.req.thinking is not None and self.req.thinking.display == "omitted"

    def stop(self, c: CompletionOutput | None, called: bool) -> tuple[str, str | None]:
        """stop_reason and stop_sequence of a finished output."""
        if c is not None and c.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if c is not None and isinstance(c.stop_reason, str) and c.stop_reason in (self.req.stop_sequences or ()):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def message(self, job: Job, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                use: dict[str, Any]) -> dict[str, Any]:
        return {"id": job.request_id.replace("msg-", "msg_", 1), "type": "message", "role": "assistant", "model": self.req.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        c = out.outputs[0]
        parsed = self.turn.parse(c)
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning:
            text = "" if self.omit_thinking else parsed.reasoning
            blocks.append({"type": "thinking", "thinking": text, "signature": signature(parsed.reasoning)})
        if parsed.content:
            blocks.append({"type": "text", "text": parsed.content})
        for call in parsed.tool_calls:
            blocks.append(tool_use_block(call["function"]["name"], call["function"]["arguments"]))
        called = any(b["type"] == "tool_use" for b in blocks)
        return self.message(job, blocks, self.stop(c, called), usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens))

    async def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        prompt_len = len(job.prompt_ids()[0])
        yield {"type": "message_start", "message": self.message(job, [], (None, None), usage(prompt_len, 0, 0))}
        yield {"type": "ping"}
        parser, blocks = self.turn.stream(), BlockStream(self.omit_thinking)
        num_tokens = cached = 0
        final: CompletionOutput | None = None
        async for _, out in outputs:
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                done = c.finish_reason is not None
                for delta in parser.deltas(c.text, final=done, token_ids=c.token_ids):
                    for event in blocks.feed(delta):
                        yield event
                if done:
                    final = c
            cached = max(cached, out.num_cached_tokens)
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = self.stop(final, blocks.called)
        use = usage(prompt_len, num_tokens, cached)
        del use["service_tier"]
        yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": use}
        yield {"type": "message_stop"}

    def sse(self, payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def error_event(self, e: BaseException) -> str:
        if isinstance(e, APIError):
            err = e
        elif isinstance(e, EngineStoppedError):  # the engine (a data-parallel replica) failed under the request
            err = APIError(503, str(e))
        else:
            logger.exception("error while streaming", exc_info=e)
            err = APIError(500, "internal server error; see the server log")
        return self.sse(err.anthropic_body())


def tool_use_block(name: str, arguments: str) -> dict[str, Any]:
    """A call as a tool_use block; a call whose arguments are not a JSON object (a model that did
    not follow its format) cannot be one, and stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return {"type": "text", "text": json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}
    return {"type": "tool_use", "id": tool_use_id(), "name": name, "input": value}


@dataclass
class BlockStream:
    """The turn's streamed OpenAI deltas as Anthropic's content-block events: a block opens when
    the kind of output changes (thinking, text, each tool call), and the open one closes before
    (a thinking block with its signature)."""

    omit_thinking: bool = False
    index: int = -1  # the open block's index
    kind: Any = None  # what the open block holds: "thinking", "text", ("tool", call index); None: none open
    thinking: str = ""  # the open thinking block's text (its signature is a digest of it)
    called: bool = False
    _events: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        self._events = []
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += text
            if not self.omit_thinking:
                self._delta({"type": "thinking_delta", "thinking": text})
        elif delta.get("content"):
            self._open("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id"):  # a call's first delta: its name (its arguments may follow in pieces)
                self.called = True
                self._open(("tool", call["index"]), {"type": "tool_use", "id": tool_use_id(), "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        return self._events

    def close(self) -> list[dict[str, Any]]:
        self._events = []
        self._close()
        return self._events

    def _open(self, kind: Any, block: dict[str, Any]) -> None:
        if kind == self.kind:
            return
        self._close()
        self.index += 1
        self.kind = kind
        self._events.append({"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> None:
        self._events.append({"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            self._delta({"type": "signature_delta", "signature": signature(self.thinking)})
            self.thinking = ""
        self._events.append({"type": "content_block_stop", "index": self.index})
        self.kind = None


async def count_tokens(ctx: ServingContext, request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's token count as /v1/messages renders it
    (system, tools, images and all); nothing is generated."""
    ctx.require_task("generate", API_NAME)
    body, large = await parse_body(ctx, request, CountTokensBody)
    ctx.check_model(body.model)
    chat, origins = chat_request(ctx, body, count_only=True)
    job = await prepare_turn(ChatTurn(ctx, chat, large), origins)
    return JSONResponse({"input_tokens": len(job.prompt_ids()[0])})


ROUTES = (
    generate_route("/v1/messages", Messages),
    Route("POST", "/v1/messages/count_tokens", count_tokens),
)
