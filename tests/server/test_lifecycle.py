"""Load shedding (503 + Retry-After past --max-waiting-requests) and graceful SIGTERM (exit 0,
in-flight request finished, new connections refused)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai_schemas import validate
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # its own server, stopped by SIGTERM (CI runs it)


@pytest.fixture(scope="module")
def small_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One request runs at a time and one may wait: the third concurrent one is shed."""
    log = tmp_path_factory.mktemp("small_server") / "server.log"
    proc = ServerProcess(
        tiny_llama, log, "--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "16",
        "--max-num-seqs", "1", "--max-waiting-requests", "1", "--shutdown-timeout", "60",
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


async def _burst(server: ServerProcess, n: int) -> list[httpx.Response]:
    body = {"model": "tiny", "prompt": "The harbour", "max_tokens": 40, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def test_queue_full_gets_503_with_retry_after(small_server: ServerProcess) -> None:
    responses = asyncio.run(_burst(small_server, 8))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    assert set(statuses) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            validate("ErrorResponse", r.json())
            assert r.json()["error"]["code"] == "queue_full"
        else:
            validate("CreateCompletionResponse", r.json())
            assert r.json()["usage"]["completion_tokens"] == 40
    small_server.wait_idle()


def test_sigterm_finishes_in_flight_request_and_exits_0(small_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "The harbour", "max_tokens": 150, "ignore_eos": True, "stream": True}
    texts, finish, done = [], None, False
    with httpx.stream("POST", small_server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:  # wait until generation is under way
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                break
        small_server.proc.send_signal(__import__("signal").SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(small_server.url + "/health", timeout=5)
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    assert done and finish == "length"
    assert small_server.proc.wait(60) == 0, small_server.log()
    assert "Traceback" not in small_server.log()
