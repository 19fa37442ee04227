"""64 concurrent streams, half dropped mid-way: every block comes back and the server still answers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers import post
from openai_schemas import validate
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # 64 concurrent streams (CI runs it)

N = 64


async def _one(client: httpx.AsyncClient, server: ServerProcess, i: int, drop: bool) -> tuple[int, str | None]:
    """Stream one chat completion; a dropped one leaves after 4 chunks. Returns (completion tokens
    the final usage chunk reports, finish reason); under load the server may fold several tokens
    into one chunk, so chunks are not counted as tokens."""
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": f"request {i}: tell me about the harbour"}],
        "stream": True, "temperature": 0.7, "seed": i, "ignore_eos": True,
        # dropped streams would run for long if their abort were lost; kept ones finish quickly
        "max_tokens": 200 if drop else 12, "stream_options": {"include_usage": True},
    }  # fmt: skip
    chunks, finish, tokens = 0, None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            validate("CreateChatCompletionStreamResponse", event)
            chunks += 1
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"]:
                finish = event["choices"][0]["finish_reason"] or finish
            if drop and chunks == 4:
                return chunks, None  # leaving the block closes the connection mid-stream
    return tokens, finish


async def _run(server: ServerProcess) -> list[tuple[int, str | None]]:
    limits = httpx.Limits(max_connections=N, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_one(client, server, i, drop=i % 2 == 0) for i in range(N)))


def test_64_streams_half_dropped(server: ServerProcess) -> None:
    before = server.wait_idle()
    results = asyncio.run(_run(server))
    kept = [r for i, r in enumerate(results) if i % 2 == 1]
    assert all(finish == "length" and tokens == 12 for tokens, finish in kept), kept
    after = server.wait_idle(timeout=30)  # dropped requests were aborted: nothing runs, no block held
    aborted = after['portside_requests_total{outcome="abort"}'] - before['portside_requests_total{outcome="abort"}']
    finished = after['portside_requests_total{outcome="length"}'] - before['portside_requests_total{outcome="length"}']
    assert aborted == N // 2 and finished == N // 2
    # far fewer tokens than 32 x 200 were generated: the aborts took effect within steps
    generated = after["portside_generation_tokens_total"] - before["portside_generation_tokens_total"]
    assert generated < (N // 2) * 12 + (N // 2) * 60, generated
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "still there?", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
