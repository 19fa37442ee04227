"""What an endpoint module sees: the serving context (one per app), the shape of its routes, and
the first stage of every request: the body read and validated, the served task and model checked."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from portside.engine.async_engine import AsyncLLMEngine
from portside.multimodal.media import MediaConnector
from portside.outputs import Logprob
from portside.server.errors import APIError, from_validation_error
from portside.server.metrics import ServerMetrics
from portside.server.offload import SMALL_BYTES, Offload
from portside.server.response_store import ResponseStore

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServingContext:
    """Everything a handler needs; one per app."""

    engine: AsyncLLMEngine
    tokenizer: Any  # a private copy of the engine's tokenizer, used on the event loop only
    offload: Offload  # where request-sized work runs (its workers have their own tokenizers)
    served_model_names: list[str]
    max_model_len: int
    metrics: ServerMetrics
    chat_template: str | None = None
    vocab_size: int = 0
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    structured: Any = None  # the engine's StructuredOutputManager (compiles are thread-safe)
    reasoning_parser: Any = None  # a portside.reasoning.ReasoningParser (--reasoning-parser)
    tool_parser: Any = None  # a portside.tool_parsers.ToolParser class (--enable-auto-tool-choice)
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    adapters: Any = None  # portside.server.lora.ServedAdapters, with --enable-lora
    allow_runtime_lora_updating: bool = False  # --allow-runtime-lora-updating: the LoRA admin routes are on
    response_role: str = "assistant"  # --response-role: the role of chat replies
    max_logprobs: int = 20  # --max-logprobs (the engine's max_logprobs; -1: no limit)
    default_sampling: dict[str, Any] = field(default_factory=dict)  # --generation-config: for fields a request leaves unset
    harmony: bool = False  # chat prompts and outputs in gpt-oss's harmony format (--chat-format; `portside.server.harmony`)
    media: Any = field(default_factory=MediaConnector)  # where image URLs may point (--allowed-*-media-*); default: data URLs only
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for previous_response_id (--responses-store-*)

    @classmethod
    def create(cls, engine: AsyncLLMEngine, served_model_names: list[str], metrics: ServerMetrics, chat_template: str | None,
               tool_parser: Any = None, trust_request_chat_template: bool = False) -> ServingContext:
        # copies keep the event loop's and the workers' tokenizers apart from the engine thread's detokenizer
        tok = copy.deepcopy(engine.engine.tokenizer)
        vocab = int(getattr(engine.engine, "vocab_size", 0) or len(tok))
        reasoning = getattr(engine.engine, "reasoning_parser", None)
        return cls(engine, tok, Offload(tok), served_model_names, engine.engine.max_model_len, metrics, chat_template, vocab,
                   structured=getattr(engine.engine, "structured", None), reasoning_parser=reasoning, tool_parser=tool_parser,
                   trust_request_chat_template=trust_request_chat_template,
                   default_sampling=dict(getattr(engine.engine, "default_sampling", None) or {}))

    def check_model(self, name: str) -> Any:
        """The LoRA adapter `name` selects (None: the base model); 404 for a name not served."""
        if name in self.served_model_names:
            return None
        lora = self.adapters.adapters.get(name) if self.adapters is not None else None
        if lora is None:
            served = [*self.served_model_names, *(self.adapters.adapters if self.adapters is not None else ())]
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", param="model", code="model_not_found")
        return lora

    def decode_token(self, token_id: int, lp: Logprob | None = None) -> str:
        """A token's text alone: the engine thread's (`Logprob.decoded_token`) where there is one,
        else decoded with this thread's tokenizer (response bodies may be built on a worker)."""
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.offload.tokenizer() if self.offload.on_worker() else self.tokenizer
        return tok.decode([token_id])

    def engine_task(self) -> str:
        """What the engine runs: "generate", or a pooling model's task (embed, classify, reward)."""
        config = getattr(self.engine.engine, "config", None)
        pooling = getattr(getattr(config, "model", None), "pooling_task", None)
        return str(pooling or getattr(self.engine.engine, "task", "generate"))

    def require_task(self, task: str, api: str) -> None:
        """400 when the engine runs another task than the endpoint (`api`, its name) needs."""
        running = self.engine_task()
        if running == task:
            return
        how = "--runner pooling" if task == "embed" else "--task generate (the default for a generating model)"
        raise APIError(400, f"The model does not support the {api} API: this server runs task {running!r}; start it with {how}",
                       code="task_not_supported")


Handler = Callable[[ServingContext, Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """One HTTP route of an endpoint module (`portside.server.endpoints`): `handler(ctx, request)`
    answers it; path parameters are in `request.path_params`."""

    method: str  # "GET" or "POST"
    path: str
    handler: Handler
    counted: bool = False  # the engine serves it: a refusal counts as rejected, a failure as an error (ServerMetrics)


async def parse_body(ctx: ServingContext, request: Request, model: type[M]) -> tuple[M, bool]:
    """Read and validate a JSON body; any problem is a 400 naming the parameter. Also says
    whether the request is large (its body over `SMALL_BYTES`: its work goes to the large lane)."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # hung up mid-body: an abort, before the engine saw anything
        ctx.metrics.requests.labels("abort").inc()
        raise APIError(499, "client disconnected") from None
    large = len(raw) > SMALL_BYTES
    try:
        if large:
            return await ctx.offload.run(model.model_validate_json, raw, large=True), True
        return model.model_validate_json(raw or b""), False
    except ValidationError as e:
        raise from_validation_error(e) from None


async def json_object(request: Request, not_object_code: str = "invalid_json") -> dict[str, Any]:
    """A small admin body (LoRA admin, dev endpoints) read as a JSON object, {} when empty; 400 otherwise."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code=not_object_code)
    return body
