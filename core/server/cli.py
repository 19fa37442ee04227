"""Flags of `portside serve` beyond the shared engine flags (`portside.engine.args.add_engine_args`)."""

from __future__ import annotations

import argparse
import json
import os


def str_list(value: str) -> list[str]:
    """A JSON list (vLLM's form: '["https://a.example"]') or comma-separated values."""
    if value.strip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [v.strip() for v in value.split(",") if v.strip()]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the server's own flags (MODEL, host/port, names, auth, limits) to `parser`."""
    from portside.tool_parsers import described as described_tool_parsers

    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )  # fmt: skip
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    g.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model name(s) clients put in the `model` field (default: MODEL as given, or the default model's name)",
    )  # fmt: skip
    g.add_argument(
        "--chat-template", default=None,
        help="Jinja chat template, as a file path or the template text (default: the tokenizer's)",
    )  # fmt: skip
    g.add_argument(
        "--api-key", default=os.environ.get("PORTSIDE_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route but /health (default: $PORTSIDE_API_KEY; unset: no key)",
    )  # fmt: skip
    g.add_argument(
        "--max-waiting-requests", type=int, default=256,
        help="sequences (prompts x n) that may wait for a batch slot; past it requests get 503 with Retry-After, and one "
             "request with more sequences than this gets 400 (default 256)",
    )  # fmt: skip
    g.add_argument(
        "--max-request-body-bytes", type=int, default=8 << 20,
        help="largest accepted request body in bytes; larger ones get 413 (default 8 MiB)",
    )  # fmt: skip
    g.add_argument(
        "--shutdown-timeout", type=float, default=60.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted (default 60)",
    )  # fmt: skip
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )  # fmt: skip
    g.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help=f"the model's tool-call format: {described_tool_parsers()}, or a plugin's",
    )  # fmt: skip
    g.add_argument(
        "--chat-format", choices=("auto", "harmony", "template"), default="auto",
        help="how chat prompts are rendered and replies parsed: harmony (gpt-oss's format, through openai-harmony: "
             "reasoning_content, tool calls, reasoning_effort), template (the Jinja chat template), or auto: harmony for "
             "gpt-oss models, else the template (default). Harmony needs the o200k_base vocabulary: offline, set "
             "TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken",
    )  # fmt: skip
    g.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="render chat templates that requests send (`chat_template`): code from clients, run under a time and size "
             "budget; refused by default",
    )  # fmt: skip
    g.add_argument(
        "--read-timeout", type=float, default=60.0,
        help="seconds a client has to send a whole request (headers and body) after connecting or starting it; "
             "slower connections are closed (default 60)",
    )  # fmt: skip
    g.add_argument(
        "--stream-stall-timeout", type=float, default=60.0,
        help="seconds a client may leave its response unread (its socket buffers full) before the connection is closed "
             "and its requests aborted (default 60)",
    )  # fmt: skip
    g.add_argument(
        "--max-connections", type=int, default=None,
        help="open connections accepted at once; past it a connection gets 503 and is closed "
             "(default: half the process's open-file limit)",
    )  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help='LoRA adapters to serve (with --enable-lora): NAME=PATH or JSON \'{"name": ..., "path": ..., '
             '"base_model_name": ...}\'; a request\'s `model` NAME selects the adapter',
    )  # fmt: skip
    g.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)",
    )  # fmt: skip
    g.add_argument(
        "--enable-dev-endpoints", action="store_true",
        help="serve /sleep, /wake_up, /is_sleeping, /pause, /resume, /reset_prefix_cache, /collective_rpc and "
             "/update_weights_from_path for reinforcement-learning trainers (off by default: 404; docs/rl.md)",
    )  # fmt: skip
    g.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level, including its access log (default info)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request (logger portside.requests; on by default)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line while busy (logger portside.stats; every 10 s by default)")
    g.add_argument(
        "--otlp-traces-endpoint", default=None, metavar="URL",
        help="export an OpenTelemetry span per request to this OTLP endpoint (needs: pip install opentelemetry-sdk "
             "opentelemetry-exporter-otlp; gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)",
    )  # fmt: skip
    g.add_argument("--root-path", default=None,
                   help="path prefix under which a path-routing proxy serves the API (e.g. /llm); requests work with or "
                        "without the prefix (FastAPI's root_path)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of chat completion replies when the request adds the generation prompt")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this PEM private key (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain) (with --ssl-keyfile)")
    g = parser.add_argument_group("OpenAI Responses store (POST /v1/responses with store: kept in memory for previous_response_id "
                                  "and GET/DELETE /v1/responses/{id})")
    g.add_argument("--responses-store-max-entries", type=int, default=1000, metavar="N",
                   help="responses kept at most; past it the least recently used go (default 1000; 0: keep none)")
    g.add_argument("--responses-store-max-bytes", type=int, default=256 << 20, metavar="N",
                   help="JSON bytes of the kept responses and their conversations at most; past it the least recently used "
                        "go (default 256 MiB)")
    g.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="S",
                   help="seconds a kept response lives after it was last stored, read or continued (default 3600)")
    g = parser.add_argument_group("images (vision-language models; data:image/...;base64 URLs are always accepted)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image_url parts name files under this folder (file:///DIR/...); symlinks and .. that lead "
                        "outside it are refused (default: no local files)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="let image_url parts name http(s):// URLs on these hosts (exact host names); redirects are "
                        "followed only within the same host (default: no remote images)")
    g.add_argument("--media-max-bytes", type=int, default=20 << 20, metavar="N",
                   help="largest encoded image accepted, from a data URL, a file or a download (default 20 MiB); note "
                        "that a data URL also counts against --max-request-body-bytes")
    g.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a remote image's whole download may take (default 10)")
    g = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    g.add_argument("--allowed-origins", type=str_list, default=None, metavar="ORIGINS",
                   help='origins browsers may call from: a JSON list (\'["https://app.example"]\', \'["*"]\') or a,b; '
                        "adds Access-Control-* headers and answers preflight requests (default: no CORS headers)")
    g.add_argument("--allowed-methods", type=str_list, default=["*"], metavar="METHODS", help="CORS methods allowed, as --allowed-origins")
    g.add_argument("--allowed-headers", type=str_list, default=["*"], metavar="HEADERS", help="CORS request headers allowed, as --allowed-origins")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and Authorization from those origins")
