"""The FastAPI app: routes, API-key and body-size guards, error handlers, engine lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portside.engine.async_engine import AsyncLLMEngine, RequestRecord, SyncEngine
from portside.server.errors import (
    APIError,
    api_error_handler,
    http_exception_handler,
    unhandled_exception_handler,
)
from portside.server.metrics import CONTENT_TYPE, ServerMetrics
from portside.server.request_log import RequestLogger, StatsLogger
from portside.server.serving_base import ServingContext
from portside.server.serving_chat import create_chat_completion
from portside.server.serving_completion import create_completion
from portside.server.serving_embedding import create_embedding, require_task
from portside.server.serving_tokenize import detokenize, model_card, model_cards, tokenize, version

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})


def _route_path(scope: Scope) -> str:
    """The request path without the --root-path prefix a proxy may have left on it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


@dataclass
class ServerConfig:
    served_model_names: list[str]
    chat_template: str | None = None  # template text (a file is read by the CLI)
    api_key: str | None = None
    max_waiting_requests: int | None = 256
    max_request_body_bytes: int = 8 << 20
    shutdown_timeout: float = 60.0  # seconds in-flight requests get to finish at shutdown
    root_path: str | None = None  # --root-path: the path prefix of a path-routing proxy (FastAPI's root_path)
    response_role: str = "assistant"  # --response-role: the role of chat replies
    # CORS (--allowed-origins ...): None: no CORS headers at all
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    tool_parser: Any = None  # a ToolParser class: tool_choice "auto" parses the model's own calls
    trust_request_chat_template: bool = False  # render templates sent with a request (a client's code)
    # connection guards (`portside.server.connections`), applied when served through `run_server`
    read_timeout: float = 60.0
    stream_stall_timeout: float = 60.0
    max_connections: int | None = None
    lora_modules: list[Any] = field(default_factory=list)  # portside.server.lora.LoRAModule, with --enable-lora
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # operator output (`portside.server.request_log`, `portside.server.tracing`)
    log_requests: bool = True  # a line per finished request (--disable-log-requests)
    log_stats: bool = True  # a stats line every log_stats_interval s while busy (--disable-log-stats)
    log_stats_interval: float = 10.0
    otlp_traces_endpoint: str | None = None  # a span per request over OTLP (--otlp-traces-endpoint)
    span_exporter: Any = None  # an OpenTelemetry SpanExporter to trace to instead (tests)
    media: Any = None  # a portside.multimodal.media.MediaConnector: where image URLs may point (None: data URLs only)
    extra: dict[str, Any] = field(default_factory=dict)


def build_app(engine: SyncEngine | list[SyncEngine], config: ServerConfig) -> FastAPI:
    """An app serving `engine`, or a list of data-parallel replicas of it
    (`portside.engine.data_parallel`); the step loops start with the app's lifespan."""
    holder: dict[str, Any] = {}
    replicas = engine if isinstance(engine, list) else [engine]
    engine = replicas[0]
    async_engine: Any  # AsyncLLMEngine, or the DataParallelEngine front with its interface
    if len(replicas) == 1:
        async_engine = AsyncLLMEngine(engine, max_waiting_requests=config.max_waiting_requests)
    else:
        from portside.engine.data_parallel import DataParallelEngine

        async_engine = DataParallelEngine(replicas, block_size=engine.config.cache.block_size,  # type: ignore[attr-defined]
                                          max_waiting_requests=config.max_waiting_requests)
    model = config.served_model_names[0]
    metrics = ServerMetrics(async_engine.stats, lambda: async_engine.num_waiting, model, engine.max_model_len,
                            engine_stats=async_engine.engine_stats, num_engines=len(replicas))
    on_done: list[Callable[[RequestRecord], None]] = [metrics.observe]
    if config.log_requests:
        on_done.append(RequestLogger(model))
    tracer = None
    if config.otlp_traces_endpoint or config.span_exporter is not None:
        from portside.server.tracing import RequestTracer

        on_done.append(tracer := RequestTracer(model, config.otlp_traces_endpoint, config.span_exporter))
    async_engine.on_request_done = functools.partial(_each, on_done)
    async_engine.on_step = metrics.observe_step

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        stats_task = None
        if config.log_stats:
            stats_task = asyncio.create_task(StatsLogger(async_engine.stats, config.log_stats_interval).run())
        holder["ctx"] = c = ServingContext.create(async_engine, config.served_model_names, metrics, config.chat_template,
                                                   config.tool_parser, config.trust_request_chat_template)
        c.response_role = config.response_role
        if config.media is not None:
            c.media = config.media
        engine_config = getattr(engine, "config", None)
        if engine_config is not None:
            c.max_logprobs = engine_config.model.max_logprobs
        if getattr(engine, "config", None) is not None and engine.config.lora is not None:  # type: ignore[attr-defined]
            from portside.server.lora import ServedAdapters

            c.adapters = ServedAdapters(config.served_model_names[0])
            for module in config.lora_modules:
                lora = c.adapters.add(module)
                await c.offload.run(engine.loras.check, lora, large=True)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            await async_engine.shutdown(config.shutdown_timeout)
            holder["ctx"].offload.shutdown()
            if stats_task is not None:
                stats_task.cancel()
            if tracer is not None:
                tracer.shutdown()

    app = FastAPI(title="portside", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  root_path=config.root_path or "")
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, unhandled_exception_handler)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins is not None:  # outermost: a browser's preflight OPTIONS carries no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)

    def ctx() -> ServingContext:
        return holder["ctx"]

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            reason = getattr(async_engine, "stopped_reason", None)  # data parallelism: which replica failed
            return APIError(503, reason() if reason is not None else "the engine is not running").response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": model_cards(ctx())})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        return JSONResponse(model_card(ctx(), model_id))

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse(version())

    @app.post("/tokenize")
    async def post_tokenize(request: Request) -> Response:
        return JSONResponse(await tokenize(ctx(), request))

    @app.post("/detokenize")
    async def post_detokenize(request: Request) -> Response:
        return JSONResponse(await detokenize(ctx(), request))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        return await _counted(create_embedding(ctx(), request))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        from portside.server.lora import load_adapter

        c = _lora_updates(ctx())
        return PlainTextResponse(await load_adapter(c.adapters, async_engine, c.offload, await _json(request), c.served_model_names))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        from portside.server.lora import unload_adapter

        c = _lora_updates(ctx())
        return PlainTextResponse(await unload_adapter(c.adapters, async_engine, await _json(request)))

    def _lora_updates(c: ServingContext) -> ServingContext:
        if c.adapters is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (--enable-lora)", code="lora_disabled")
        if not config.allow_runtime_lora_updating:
            raise APIError(400, "loading and unloading adapters while serving is off; start the server with "
                           "--allow-runtime-lora-updating", code="runtime_lora_updating_disabled")
        return c

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _counted(_generation(create_completion, "Completions", request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _counted(_generation(create_chat_completion, "Chat Completions", request))

    async def _generation(handler: Any, api: str, request: Request) -> Any:
        require_task(ctx(), "generate", api)  # a --task embed server only embeds
        return await handler(ctx(), request)

    async def _counted(handler: Awaitable[Any]) -> Any:
        try:
            return await handler
        except APIError as e:  # refused before or by the engine: bad input, unknown model, queue full
            if e.status != 499:  # a client that left mid-request is counted as an abort
                metrics.rejected()
            raise
        except Exception:
            logger.exception("error serving a generation request")
            metrics.requests.labels("error").inc()
            raise APIError(500, "internal server error; see the server log") from None

    return app


def _each(callbacks: list[Callable[[RequestRecord], None]], record: RequestRecord) -> None:
    """Hand an ended request's record to every observer; one failing never stops the others."""
    for callback in callbacks:
        try:
            callback(record)
        except Exception:
            logger.exception("request observer %r failed", callback)


async def _json(request: Request) -> dict[str, Any]:
    import json

    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every route but /health (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # compare_digest runs in time independent of where the strings differ
        ok = hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
        if not ok:
            message = "Incorrect API key provided" if auth else "Missing API key: send 'Authorization: Bearer <key>'"
            response = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`, by Content-Length or by counting as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
            return message

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large").response()
        await response(scope, receive, send)
