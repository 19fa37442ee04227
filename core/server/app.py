"""The FastAPI app: the engine front and its observers, the lifespan that starts and stops them,
the guards and error handlers, and the routes of `portside.server.endpoints.ENDPOINTS`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from portside.engine.async_engine import AsyncLLMEngine, SyncEngine
from portside.engine.stats import RequestRecord
from portside.server.context import Route, ServingContext
from portside.server.endpoints import ENDPOINTS
from portside.server.errors import (
    APIError,
    api_error_handler,
    http_exception_handler,
    unhandled_exception_handler,
)
from portside.server.harmony import use_harmony
from portside.server.lora import ServedAdapters
from portside.server.metrics import ServerMetrics
from portside.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from portside.server.pipeline import counted
from portside.server.request_log import RequestLogger, StatsLogger

logger = logging.getLogger(__name__)


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
    chat_format: str = "auto"  # --chat-format: "harmony" (gpt-oss), "template" (Jinja), "auto" (harmony for gpt-oss)
    trust_request_chat_template: bool = False  # render templates sent with a request (a client's code)
    # connection guards (`portside.server.connections`), applied when served through `run_server`
    read_timeout: float = 60.0
    stream_stall_timeout: float = 60.0
    max_connections: int | None = None
    lora_modules: list[Any] = field(default_factory=list)  # portside.server.lora.LoRAModule, with --enable-lora
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    enable_dev_endpoints: bool = False  # /sleep, /wake_up, /pause, ... (`endpoints.dev`); 404 without
    # operator output (`portside.server.request_log`, `portside.server.tracing`)
    log_requests: bool = True  # a line per finished request (--disable-log-requests)
    log_stats: bool = True  # a stats line every log_stats_interval s while busy (--disable-log-stats)
    log_stats_interval: float = 10.0
    otlp_traces_endpoint: str | None = None  # a span per request over OTLP (--otlp-traces-endpoint)
    span_exporter: Any = None  # an OpenTelemetry SpanExporter to trace to instead (tests)
    media: Any = None  # a portside.multimodal.media.MediaConnector: where image URLs may point (None: data URLs only)
    response_store: Any = None  # a portside.server.response_store.ResponseStore (--responses-store-*; None: its defaults)
    extra: dict[str, Any] = field(default_factory=dict)


def build_app(engine: SyncEngine | list[SyncEngine], config: ServerConfig) -> FastAPI:
    """An app serving `engine`, or a list of data-parallel replicas of it
    (`portside.engine.data_parallel`); the step loops start with the app's lifespan."""
    replicas = engine if isinstance(engine, list) else [engine]
    async_engine = _engine_front(replicas, config)
    metrics = ServerMetrics(async_engine.stats, lambda: async_engine.num_waiting, config.served_model_names[0],
                            replicas[0].max_model_len, engine_stats=async_engine.engine_stats, num_engines=len(replicas))
    tracer = _observe(async_engine, metrics, config)
    holder: dict[str, ServingContext] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        stats_task = None
        if config.log_stats:
            stats_task = asyncio.create_task(StatsLogger(async_engine.stats, config.log_stats_interval).run())
        holder["ctx"] = await _serving_context(async_engine, replicas[0], metrics, config)
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
    app.state.dev_endpoints = config.enable_dev_endpoints
    _guard(app, config)
    for module in ENDPOINTS:
        for route in module.ROUTES:
            app.add_api_route(route.path, _endpoint(route, holder), methods=[route.method])
    return app


def _engine_front(replicas: list[SyncEngine], config: ServerConfig) -> Any:
    """The async engine over one engine, or the DataParallelEngine front (its interface) over replicas."""
    if len(replicas) == 1:
        return AsyncLLMEngine(replicas[0], max_waiting_requests=config.max_waiting_requests)
    from portside.engine.data_parallel import DataParallelEngine

    return DataParallelEngine(replicas, block_size=replicas[0].config.cache.block_size,  # type: ignore[attr-defined]
                              max_waiting_requests=config.max_waiting_requests)


def _observe(async_engine: Any, metrics: ServerMetrics, config: ServerConfig) -> Any:
    """Hand each ended request to the metrics, the request log and the tracer, and each step to
    the metrics; returns the tracer (None without tracing)."""
    model = config.served_model_names[0]
    on_done: list[Callable[[RequestRecord], None]] = [metrics.observe]
    if config.log_requests:
        on_done.append(RequestLogger(model))
    tracer = None
    if config.otlp_traces_endpoint or config.span_exporter is not None:
        from portside.server.tracing import RequestTracer

        on_done.append(tracer := RequestTracer(model, config.otlp_traces_endpoint, config.span_exporter))
    async_engine.on_request_done = functools.partial(_each, on_done)
    async_engine.on_step = metrics.observe_step
    return tracer


async def _serving_context(async_engine: Any, engine: SyncEngine, metrics: ServerMetrics, config: ServerConfig) -> ServingContext:
    """The handlers' context, once the engine runs; the --lora-modules adapters checked and served."""
    c = ServingContext.create(async_engine, config.served_model_names, metrics, config.chat_template, config.tool_parser,
                              config.trust_request_chat_template)
    c.response_role = config.response_role
    c.harmony = use_harmony(config.chat_format, getattr(getattr(getattr(engine, "config", None), "model", None), "path", None))
    c.allow_runtime_lora_updating = config.allow_runtime_lora_updating
    if config.media is not None:
        c.media = config.media
    if config.response_store is not None:
        c.response_store = config.response_store
    engine_config = getattr(engine, "config", None)
    if engine_config is not None:
        c.max_logprobs = engine_config.model.max_logprobs
    if engine_config is not None and engine_config.lora is not None:
        c.adapters = ServedAdapters(config.served_model_names[0])
        for module in config.lora_modules:
            lora = c.adapters.add(module)
            await c.offload.run(engine.loras.check, lora, large=True)  # type: ignore[attr-defined]
    return c


def _guard(app: FastAPI, config: ServerConfig) -> None:
    """Error handlers, the body limit, the API key and CORS."""
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


def _endpoint(route: Route, holder: dict[str, ServingContext]) -> Callable[[Request], Any]:
    """The FastAPI endpoint of `route`: its handler with the app's context (counted, when the engine serves it)."""

    async def endpoint(request: Request) -> Response:
        ctx = holder["ctx"]
        if route.counted:
            return await counted(ctx, route.handler(ctx, request))
        return await route.handler(ctx, request)

    endpoint.__name__ = route.handler.__name__ if hasattr(route.handler, "__name__") else route.path
    return endpoint


def _each(callbacks: list[Callable[[RequestRecord], None]], record: RequestRecord) -> None:
    """Hand an ended request's record to every observer; one failing never stops the others."""
    for callback in callbacks:
        try:
            callback(record)
        except Exception:
            logger.exception("request observer %r failed", callback)
