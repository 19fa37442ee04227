"""`portside disagg-proxy`: one OpenAI endpoint in front of a prefill instance and a decode instance.

For /v1/completions and /v1/chat/completions the proxy first sends the request to a prefill
instance (`portside serve --kv-connector shared_storage --kv-role producer`) with `max_tokens=1`
and without streaming: it computes the prompt, its blocks land in the shared directory before it
answers (`portside.kv_transfer.shared_storage`). Then the original request goes to a decode
instance (`--kv-role consumer`), which loads those blocks instead of computing them, and its
answer (streamed or not) goes back to the client as it is. Nothing else passes between the two:
blocks are found by the prompt's content hash.

Failures are OpenAI-style errors, never a hang: a prefill instance that answers with an error has
that error passed on (its status and body); one that cannot be reached, or dies mid-request, is a
502 naming it (the decode instance is not asked). A decode instance that cannot be reached is a
502 too; one that fails mid-stream ends the stream with an error event. A prefill instance that
dies after writing only some blocks costs the decode instance a recompute of the rest, nothing
more (the files are checksummed and written under temporary names). Every request has a timeout
(`--timeout`). Other routes (/v1/models, /tokenize, ...) go to a decode instance. With several
`--prefill` or `--decode` URLs, requests take them in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def _error(status: int, message: str, kind: str = "bad_gateway") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status)


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token (so no min_tokens), no streaming."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "x-request-id")}


def build_app(prefill: list[str], decode: list[str], timeout: float = 600.0) -> FastAPI:
    """The proxy's app: `prefill` and `decode` are the instances' base URLs (http://host:port)."""
    if not prefill or not decode:
        raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL")
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        for url in (*prefill, *decode):
            try:
                r = await client.get(f"{url}/health", timeout=5.0)
            except httpx.HTTPError as e:
                return _error(503, f"{url} is unreachable: {e}", "service_unavailable_error")
            if r.status_code != 200:
                return _error(503, f"{url}/health answered {r.status_code}", "service_unavailable_error")
        return Response(status_code=200)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as e:
            return _error(400, f"the body is not valid JSON ({e})", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        headers, path = _headers(request), request.url.path
        p_url = next(prefills)
        try:
            r = await client.post(f"{p_url}{path}", json=_prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"prefill instance {p_url} failed: {type(e).__name__}: {e}")
        if r.status_code != 200:  # the instance's own OpenAI error (a 400 for a bad parameter, ...)
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return await _forward(client, f"{next(decodes)}{path}", body, headers, "decode instance")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str, request: Request) -> Response:
        url = f"{next(decodes)}/{path}"
        try:
            r = await client.request(request.method, url, content=await request.body(), headers=_headers(request),
                                     params=request.query_params)
        except httpx.HTTPError as e:
            return _error(502, f"{url} failed: {type(e).__name__}: {e}")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app


async def _forward(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                   what: str) -> Response:
    """POST `body` to `url`; its answer as it is, streamed through when it streams."""
    req = client.build_request("POST", url, json=body, headers=headers)
    try:
        r = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        return _error(502, f"{what} {url} failed: {type(e).__name__}: {e}")
    kept = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await r.aread()
        except httpx.HTTPError as e:
            return _error(502, f"{what} {url} failed mid-answer: {type(e).__name__}: {e}")
        finally:
            await r.aclose()
        return Response(content, status_code=r.status_code, headers=kept)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the client sees an error event, then the end of the stream
            err = {"error": {"message": f"{what} failed mid-stream: {type(e).__name__}: {e}", "type": "bad_gateway",
                             "param": None, "code": 502}}
            yield f"\n\ndata: {json.dumps(err)}\n\n".encode()
        finally:
            await r.aclose()

    return StreamingResponse(relay(), status_code=r.status_code, headers=kept)


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance's base URL, e.g. http://localhost:8100 (repeatable: taken in turn)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance's base URL, e.g. http://localhost:8200 (repeatable: taken in turn)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for an instance's answer (default 600)")


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    for url in (*args.prefill, *args.decode):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"disagg-proxy: {url!r} is not an http(s) URL (e.g. http://localhost:8100)")
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
