"""The RL dev endpoints (issue 50) from httpx against `portside serve --enable-dev-endpoints`:
weight updates from a second checkpoint (greedy tokens equal transformers' on it), sleep and
wake-up (503 while asleep), pause and resume (keep and abort), collective_rpc, prefix cache
reset; bad input is a 400 with the model unchanged; and every route is 404 without the flag."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from portside.testing.tiny import hf_greedy, make_tiny_model

PROMPT = [5, 9, 23, 41, 7, 8, 99, 3, 17]
MAX_TOKENS = 8
ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"), ("POST", "/resume"),
          ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"),
          ("POST", "/update_weights_from_path")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dev")
    return make_tiny_model(root / "a", seed=0), make_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def dev_server(ckpts, tmp_path_factory):
    proc = ServerProcess(ckpts[0], tmp_path_factory.mktemp("devlog") / "server.log", "--max-model-len", "128",
                         "--block-size", "4", "--num-kv-blocks", "128", "--enable-dev-endpoints")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def call(server: ServerProcess, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=server.headers, timeout=60, **kw)


def complete(server: ServerProcess, prompt=PROMPT, max_tokens=MAX_TOKENS) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return call(server, "POST", "/v1/completions", json=body)


def text(server: ServerProcess) -> str:
    """The greedy completion's text (an incomplete UTF-8 character at its end is held back)."""
    r = complete(server)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"].rstrip("\ufffd")


def oracle(path: Path) -> str:
    """transformers' greedy continuation, as the server's text (the ids decoded by the same tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, PROMPT, MAX_TOKENS)).rstrip("\ufffd")


def test_routes_are_404_without_the_flag(server):
    for method, path in ROUTES:
        r = call(server, method, path)
        assert r.status_code == 404, (path, r.text)
        assert "--enable-dev-endpoints" in r.json()["error"]["message"]


def test_update_weights_from_path(dev_server, ckpts):
    a, b = ckpts
    assert text(dev_server) == oracle(a)
    bad = [({"path": str(a / "missing")}, "not a folder"), ({}, "path must be"), ({"path": 3}, "path must be")]
    for body, message in bad:
        r = call(dev_server, "POST", "/update_weights_from_path", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = call(dev_server, "POST", "/update_weights_from_path", json={"path": str(b)})
    assert r.status_code == 200 and r.json()["num_tensors"] > 0, r.text
    assert text(dev_server) == oracle(b)
    call(dev_server, "POST", "/update_weights_from_path", json={"path": str(a)})
    assert text(dev_server) == oracle(a)


def test_collective_rpc_and_reset(dev_server):
    r = call(dev_server, "POST", "/collective_rpc", json={"method": "update_weights_from_path", "args": ["/nonexistent"]})
    assert r.status_code == 400 and "not a folder" in r.json()["error"]["message"]
    for body in ({"method": "nope"}, {"method": "_rebuild_graphs"}, {"args": []}, {"method": "sleep", "args": 1}):
        assert call(dev_server, "POST", "/collective_rpc", json=body).status_code == 400, body
    assert call(dev_server, "POST", "/reset_prefix_cache").status_code == 200


def test_sleep_and_wake(dev_server, ckpts):
    want = text(dev_server)
    assert call(dev_server, "POST", "/sleep", params={"level": "3"}).status_code == 400
    assert call(dev_server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    r = call(dev_server, "POST", "/sleep", params={"level": "1"})
    assert r.status_code == 200, r.text
    assert call(dev_server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    r = complete(dev_server)
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    r = call(dev_server, "POST", "/update_weights_from_path", json={"path": str(ckpts[1])})
    assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
    assert call(dev_server, "POST", "/wake_up", params={"tags": "gpu"}).status_code == 400
    assert call(dev_server, "POST", "/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": True}
    assert call(dev_server, "POST", "/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": False}
    assert text(dev_server) == want
    # level 2: refused until the weights are updated
    assert call(dev_server, "POST", "/sleep", params={"level": "2"}).status_code == 200
    assert call(dev_server, "POST", "/wake_up").status_code == 200
    assert complete(dev_server).status_code == 503
    assert call(dev_server, "POST", "/update_weights_from_path", json={"path": str(ckpts[0])}).status_code == 200
    assert text(dev_server) == want


def test_pause_keep_and_abort(dev_server):
    want = text(dev_server)
    assert call(dev_server, "POST", "/pause", params={"mode": "sometimes"}).status_code == 400

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=dev_server.url, headers=dev_server.headers, timeout=60) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            assert (await c.post("/pause", params={"mode": "keep"})).json() == {"is_paused": True}
            assert (await c.get("/is_paused")).json() == {"is_paused": True}
            pending = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(1.0)
            assert not pending.done()  # accepted, not scheduled while paused
            assert (await c.post("/resume")).json() == {"is_paused": False}
            r = await pending
            assert r.status_code == 200 and r.json()["choices"][0]["text"].rstrip("\ufffd") == want
            # abort: a request in flight (held by a pause that keeps it) ends, then the server serves again
            await c.post("/pause", params={"mode": "keep"})
            held = asyncio.create_task(c.post("/v1/completions", json=dict(body, max_tokens=100)))
            await asyncio.sleep(0.5)
            assert (await c.post("/pause", params={"mode": "abort"})).status_code == 200
            r = await held
            assert r.status_code != 200 or r.json()["usage"]["completion_tokens"] < 100, r.text
            assert (await c.get("/is_paused")).json() == {"is_paused": True}
            # wait: the request in flight finishes whole, then the server pauses
            await c.post("/resume")
            running = asyncio.create_task(c.post("/v1/completions", json=dict(body, max_tokens=40)))
            await asyncio.sleep(0.1)
            r = await c.post("/pause", params={"wait_for_inflight_requests": "true"})
            assert r.json() == {"is_paused": True}
            assert (await running).json()["usage"]["completion_tokens"] == 40
            await c.post("/resume")
            r = await c.post("/v1/completions", json=body)
            assert r.json()["choices"][0]["text"].rstrip("\ufffd") == want

    asyncio.run(scenario())
