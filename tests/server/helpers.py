"""Raw HTTP helpers for the server tests (the openai client hides the bodies we validate)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from server_process import ServerProcess


def post(server: ServerProcess, path: str, body: Any = None, *, content: bytes | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    h = dict(server.headers, **(headers or {}))
    if content is None:
        return httpx.post(server.url + path, json=body, headers=h, timeout=60)
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def sse_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `data:` event of a streamed response, parsed; asserts the stream ends with [DONE]."""
    events: list[Any] = []
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]
