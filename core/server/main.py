"""`portside serve`: build the engine, then run the app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from typing import Any

from portside.server.app import ServerConfig, build_app
from portside.server.connections import guarded_protocol

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template` is a file path or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [args.model if args.model else DEFAULT_MODEL_NAME]
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be non-negative")
    tool_parser = None
    if args.enable_auto_tool_choice:
        if not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral)")
        from portside.tool_parsers import get_tool_parser

        tool_parser = get_tool_parser(args.tool_call_parser)
    elif args.tool_call_parser:
        raise ValueError("--tool-call-parser is used by tool_choice \"auto\": add --enable-auto-tool-choice")
    for flag in ("read_timeout", "stream_stall_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    if args.otlp_traces_endpoint:  # without OpenTelemetry: exit 2 naming the install, before the model loads
        from portside.server.tracing import check_available

        check_available()
    return ServerConfig(
        served_model_names=list(names),
        tool_parser=tool_parser,
        chat_template=read_chat_template(args.chat_template),
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        read_timeout=args.read_timeout,
        stream_stall_timeout=args.stream_stall_timeout,
        max_connections=args.max_connections if args.max_connections is not None else default_max_connections(),
        lora_modules=_lora_modules(args),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
        log_stats_interval=float(os.environ.get("PORTSIDE_LOG_STATS_INTERVAL", "10")),  # internal: tests shorten it
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def _lora_modules(args: argparse.Namespace) -> list[Any]:
    if not args.lora_modules:
        if args.allow_runtime_lora_updating and not args.enable_lora:
            raise ValueError("--allow-runtime-lora-updating loads LoRA adapters: add --enable-lora")
        return []
    if not args.enable_lora:
        raise ValueError("--lora-modules serves LoRA adapters: add --enable-lora")
    from portside.server.lora import parse_lora_modules

    modules = parse_lora_modules(args.lora_modules)
    names = args.served_model_name or []
    clash = [m.name for m in modules if m.name in names]
    if clash:
        raise ValueError(f"--lora-modules: {clash[0]!r} is also a --served-model-name")
    return modules


def default_max_connections() -> int:
    """Half the process's open-file limit: the rest stays for the model's files, logs and workers."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 2) if soft != resource.RLIM_INFINITY else 4096


class RedactSecrets(logging.Filter):
    """Blank query-string values that look like credentials in uvicorn's access log."""

    _SECRET = re.compile(r"([?&](?:[^=&]*(?:key|token|secret|password|auth)[^=&]*)=)[^&\s]*", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._SECRET.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; in-flight requests finish first. Returns the exit code."""
    import uvicorn

    from portside.engine.args import engine_kwargs
    from portside.engine.llm_engine import LLMEngine

    __import__("portside.server.debug_memory", fromlist=["_"]).install_from_env()  # PORTSIDE_TRACEMALLOC=1: soak bench
    config = server_config(args)
    engine = LLMEngine.from_args(model=args.model, **engine_kwargs(args))
    if config.lora_modules:  # a bad adapter stops the start here, with its message (exit 2)
        from portside.lora.request import LoRARequest

        try:
            for i, m in enumerate(config.lora_modules, 1):  # the ids ServedAdapters gives them
                engine.loras.check(LoRARequest(m.name, i, m.path, m.base_model_name))
        except ValueError:
            engine.shutdown()
            raise
    quant = engine.config.model.quantization
    print(f"portside: model weights {engine.weight_bytes / 2**20:.1f} MiB "
          f"({quant.describe() if quant else str(engine.config.model.dtype).removeprefix('torch.')}), "
          f"{engine.num_blocks} KV-cache blocks", file=sys.stderr, flush=True)
    app = build_app(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            # uvicorn annotates int but only hands it to asyncio.wait_for(timeout=), which takes a float
            timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type]
            lifespan="on",
            http=guarded_protocol(config.read_timeout, config.stream_stall_timeout, config.max_connections),
        )
    )
    logging.getLogger("uvicorn.access").addFilter(RedactSecrets())
    from portside.server.request_log import request_logger, show_at_default_level, stats_logger

    show_at_default_level(*[log for log, on in ((request_logger, config.log_requests), (stats_logger, config.log_stats)) if on])
    # uvicorn re-raises the signal it shut down on once it is done; with these handlers in place
    # that is a no-op, so a SIGTERM'd server exits 0 after its graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s as %s on http://%s:%d", args.model or "the default model", config.served_model_names, args.host, args.port)
    server.run()
    return 0 if server.started else 1
