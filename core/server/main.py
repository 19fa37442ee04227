"""`portside serve`: build the engine, then run the app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import socket
import sys
from typing import Any

from portside.server.app import ServerConfig, build_app
from portside.server.connections import guarded_protocol
from portside.server.harmony import HARMONY_TOOL_PARSER, load_encoding, use_harmony

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


# flags ServerConfig takes as they are, under their own names
_AS_IS = ("max_waiting_requests", "max_request_body_bytes", "shutdown_timeout", "trust_request_chat_template", "read_timeout",
          "stream_stall_timeout", "allow_runtime_lora_updating", "otlp_traces_endpoint", "enable_dev_endpoints")


def server_config(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [args.model if args.model else DEFAULT_MODEL_NAME]
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be non-negative")
    harmony = use_harmony(getattr(args, "chat_format", "auto"), args.model)
    tool_parser = None
    if args.enable_auto_tool_choice:
        if not args.tool_call_parser:
            from portside.tool_parsers import TOOL_PARSERS

            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
        if harmony and args.tool_call_parser != HARMONY_TOOL_PARSER:
            raise ValueError(f"--tool-call-parser {args.tool_call_parser}: this model's tool calls are harmony's (gpt-oss), "
                             f"parsed without a parser; drop the flag (or name vLLM's {HARMONY_TOOL_PARSER!r}), or render "
                             "with --chat-format template")
        if args.tool_call_parser == HARMONY_TOOL_PARSER and not harmony:
            raise ValueError(f"--tool-call-parser {HARMONY_TOOL_PARSER} reads gpt-oss's harmony tool calls: serve a gpt-oss "
                             "model, or add --chat-format harmony")
        if not harmony:
            from portside.tool_parsers import get_tool_parser

            tool_parser = get_tool_parser(args.tool_call_parser)
    elif args.tool_call_parser:
        raise ValueError("--tool-call-parser is used by tool_choice \"auto\": add --enable-auto-tool-choice")
    for flag in ("read_timeout", "stream_stall_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    if harmony:  # gpt-oss without its vocabulary: exit 2 saying how, before the model loads
        load_encoding()
    if args.otlp_traces_endpoint:  # without OpenTelemetry: exit 2 naming the install, before the model loads
        from portside.server.tracing import check_available

        check_available()
    return ServerConfig(
        served_model_names=list(names),
        tool_parser=tool_parser,
        chat_format=getattr(args, "chat_format", "auto"),
        chat_template=read_chat_template(args.chat_template),
        api_key=args.api_key or None,
        max_connections=args.max_connections if args.max_connections is not None else default_max_connections(),
        lora_modules=_lora_modules(args),
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
        log_stats_interval=float(os.environ.get("PORTSIDE_LOG_STATS_INTERVAL", "10")),  # internal: tests shorten it
        root_path=_root_path(args.root_path),
        response_role=_response_role(args.response_role),
        media=_media(args),
        response_store=_response_store(args),
        **{name: getattr(args, name) for name in _AS_IS},
        **_cors(args),
    )


def _media(args: argparse.Namespace) -> Any:
    """The image loader of --allowed-local-media-path, --allowed-media-domains, --media-max-bytes
    and --media-fetch-timeout (ValueError naming the flag)."""
    from portside.multimodal.media import MediaConnector

    if args.media_max_bytes < 1:
        raise ValueError(f"--media-max-bytes must be a positive number of bytes, got {args.media_max_bytes}")
    if not args.media_fetch_timeout > 0:
        raise ValueError(f"--media-fetch-timeout must be a positive number of seconds, got {args.media_fetch_timeout}")
    path = args.allowed_local_media_path
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"--allowed-local-media-path {path!r} is not a folder")
    try:
        return MediaConnector(allowed_local_media_path=path, allowed_media_domains=tuple(args.allowed_media_domains or ()),
                              max_bytes=args.media_max_bytes, fetch_timeout_s=args.media_fetch_timeout)
    except ValueError as e:
        msg = str(e)
        name = msg.split(" ", 1)[0].rstrip(":")
        raise ValueError("--" + name.replace("_", "-") + msg[len(name):] if name.islower() and "_" in name else msg) from None


def _response_store(args: argparse.Namespace) -> Any:
    """The bounded in-memory store of /v1/responses (--responses-store-*; ValueError naming the flag)."""
    from portside.server.response_store import ResponseStore

    return ResponseStore(args.responses_store_max_entries, args.responses_store_max_bytes, args.responses_store_ttl)


def _root_path(value: str | None) -> str | None:
    if not value:
        return None
    if not value.startswith("/"):
        raise ValueError(f"--root-path {value!r} must start with / (e.g. /llm)")
    return value.rstrip("/") or None


def _response_role(value: str) -> str:
    if not value or not value.strip():
        raise ValueError("--response-role must not be empty (default: assistant)")
    return value


def _cors(args: argparse.Namespace) -> dict[str, Any]:
    if args.allowed_origins is None:
        for flag, value, default in (("--allowed-methods", args.allowed_methods, ["*"]),
                                     ("--allowed-headers", args.allowed_headers, ["*"]),
                                     ("--allow-credentials", args.allow_credentials, False)):
            if value != default:
                raise ValueError(f"{flag} configures CORS, which is off: add --allowed-origins")
        return {}
    if args.allow_credentials and "*" in args.allowed_origins:
        logger.warning("--allow-credentials with --allowed-origins '*': browsers refuse credentials for a wildcard "
                       "origin; list the origins")
    return dict(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


def ssl_files(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's ssl_keyfile/ssl_certfile, checked: both or neither, and readable."""
    key, cert = args.ssl_keyfile, args.ssl_certfile
    if bool(key) != bool(cert):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if not key:
        return {}
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r} is not a file")
    return {"ssl_keyfile": key, "ssl_certfile": cert}


def check_port(host: str, port: int) -> None:
    """Fail fast (before the model loads) when host:port cannot be listened on."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve ({e.strerror}); use an address such as 127.0.0.1 or 0.0.0.0") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no obstacle
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is in use; pick another with --port") from None
            if e.errno == errno.EACCES:
                raise ValueError(f"port {port} on {host} needs privileges; pick one above 1023 with --port") from None
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port") from None


def banner(engine: Any, args: argparse.Namespace, config: ServerConfig, scheme: str) -> str:
    """What `portside serve` says it serves, at the default log level."""
    c = engine.config
    quant = c.model.quantization
    dtype = str(c.model.dtype).removeprefix("torch.") + (f", quantization {quant.describe()}" if quant else "")
    try:
        with open(os.path.join(c.model.path, "config.json")) as f:
            architecture = (json.load(f).get("architectures") or ["?"])[0]
    except (OSError, ValueError):
        architecture = "?"
    try:
        device = f"{c.device} ({engine.platform.device_info().name})"
    except Exception:  # a plugin's memory query must not stop the start
        device = c.device
    blocks, size, dp = engine.num_blocks, c.cache.block_size, c.parallel.data_parallel_size
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"{scheme}://{host}:{args.port}{config.root_path or ''}"
    return "\n".join([
        f"portside: serving {args.model or DEFAULT_MODEL_NAME + ' (the embedded default model)'}",
        f"  architecture {architecture}, dtype {dtype}, model weights {engine.weight_bytes / 2**20:.1f} MiB",
        f"  device {device}",
        f"  KV cache {blocks} blocks x {size} tokens = {blocks * size} tokens, max_model_len {c.model.max_model_len}"
        + (f" (per replica)\n  data parallel: {dp} replicas, each on {c.parallel.world_size} worker process(es)" if dp > 1 else ""),
        f"  served model name(s): {', '.join(config.served_model_names)}",
        f"  listening on {url} (OpenAI API under {url}/v1)",
    ])


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


def start_engines(args: argparse.Namespace) -> list[Any]:
    """The engine, or with --data-parallel-size D > 1 its D replicas (`portside.engine.data_parallel`)."""
    from portside.engine.args_cli import engine_kwargs
    from portside.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    dp = kwargs.pop("data_parallel_size", 1)
    if isinstance(dp, int) and dp > 1:
        from portside.engine.data_parallel import start_replicas

        return start_replicas(dp, model=args.model, **kwargs)
    return [LLMEngine.from_args(model=args.model, data_parallel_size=dp, **kwargs)]


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; in-flight requests finish first. Returns the exit code."""
    import uvicorn

    __import__("portside.server.debug_memory", fromlist=["_"]).install_from_env()  # PORTSIDE_TRACEMALLOC=1: soak bench
    config = server_config(args)
    ssl = ssl_files(args)
    check_port(args.host, args.port)  # before the model loads: a taken port fails in a second, not after it
    replicas = start_engines(args)
    engine = replicas[0]
    if config.lora_modules:  # a bad adapter stops the start here, with its message (exit 2)
        from portside.lora.request import LoRARequest

        try:
            for i, m in enumerate(config.lora_modules, 1):  # the ids ServedAdapters gives them
                engine.loras.check(LoRARequest(m.name, i, m.path, m.base_model_name))
        except ValueError:
            for e in replicas:
                e.shutdown()
            raise
    print(banner(engine, args, config, "https" if ssl else "http"), file=sys.stderr, flush=True)
    app = build_app(replicas if len(replicas) > 1 else engine, config)
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
            **ssl,  # type: ignore[arg-type]
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
