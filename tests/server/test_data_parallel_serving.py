"""`portside serve -dp 2`: two engine replicas, each in its own worker process, behind one server.
Concurrent requests carry transformers' greedy tokens and validate against OpenAI's schemas; both
replicas work (per-engine `vllm:*` series) and requests sharing a long prefix go to the replica
that cached it; a killed replica worker fails requests with a clear 503 within seconds, /health
turns unhealthy and nothing is orphaned; an adapter loaded at run time serves on both replicas;
`-dp 0` exits 2."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import post
from openai_schemas import validate
from server_process import ServerProcess

from portside.testing.tiny import hf_greedy

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 12


def start(model: Path, tmp_path: Path) -> ServerProcess:
    return ServerProcess(model, tmp_path / "server.log", "--max-model-len", "256", "--block-size", str(BLOCK),
                         "--num-kv-blocks", "200", "-dp", "2").wait_ready()


def by_engine(server: ServerProcess, name: str) -> dict[str, float]:
    """Sum of the samples of metric `name` per `engine` label."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf'{re.escape(name)}\{{([^}}]*)\}} (\S+)$', line)
        if m:
            engine = re.search(r'engine="(\d+)"', m.group(1))
            assert engine is not None, line
            out[engine.group(1)] = out.get(engine.group(1), 0.0) + float(m.group(2))
    return out


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes (its descendants named portside-tp<rank>: not the fork
    server they are forked from, not multiprocessing's resource tracker)."""
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm") as f:
                procs[int(entry)] = (ppid, f.read().strip())
        except OSError:
            continue

    def descends(pid: int) -> bool:
        while pid in procs and pid != server_pid:
            pid = procs[pid][0]
        return pid == server_pid

    return sorted(p for p, (_, comm) in procs.items() if comm.startswith("portside-") and descends(p))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def complete(server: ServerProcess, ids: list[int], max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True})


def test_dp2_server_gives_greedy_tokens_balances_keeps_prefixes_together_and_notices_an_idle_death(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    shared = [(37 * k) % 300 + 5 for k in range(3 * BLOCK)]  # three full blocks in common
    grouped = [shared + [310 + i, 311 + i] for i in range(4)]
    distinct = [[(17 * i + 29 * k) % 350 + 3 for k in range(9)] for i in range(6)]  # shorter than a block: by load
    server = start(tiny_llama, tmp_path)
    pids = worker_pids(server.proc.pid)
    try:
        assert len(pids) == 2
        first = complete(server, grouped[0])  # computes the shared prefix on one replica
        assert first.status_code == 200, first.text
        done = by_engine(server, "vllm:request_success_total")
        owner = max(done, key=lambda e: done[e])
        assert done[owner] == 1 and sum(done.values()) == 1
        rest = grouped[1:] + distinct
        with ThreadPoolExecutor(len(rest)) as pool:
            responses = [first, *pool.map(lambda ids: complete(server, ids), rest)]
        for ids, r in zip(grouped[:1] + rest, responses, strict=True):
            assert r.status_code == 200, r.text
            body = r.json()
            validate("CreateCompletionResponse", body)
            usage = body["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), MAX_TOKENS)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == (len(shared) if ids in grouped[1:] else 0), (ids, usage)  # on the replica that has it
            want = tok.decode(hf_greedy(tiny_llama, ids, MAX_TOKENS), skip_special_tokens=True)
            assert want.startswith(body["choices"][0]["text"].rstrip("\ufffd"))
        done = by_engine(server, "vllm:request_success_total")
        assert sum(done.values()) == 1 + len(rest) and min(done.values()) > 0, done  # both replicas worked
        hits = by_engine(server, "vllm:prefix_cache_hits_total")
        assert hits[owner] >= 3 * len(shared), hits  # the other three grouped prompts hit the cached prefix there
        assert sum(hits.values()) - hits[owner] == 0, hits
        idle = server.wait_idle()
        assert idle["portside_kv_cache_total_blocks"] == 400  # summed over both replicas
        assert server.health().status_code == 200
        os.kill(pids[1], signal.SIGKILL)  # while idle: noticed without a request
        deadline = time.monotonic() + 5
        while server.health().status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.health().status_code == 503
        assert "exited while the engine was idle" in server.log()
    finally:
        assert server.terminate() == 0, server.log()[-3000:]
    assert not any(alive(p) for p in pids)


def stream_events(server: ServerProcess, ids: list[int], started: threading.Event) -> list[dict]:
    """The data events of a streamed completion (n = 4, to the context's end); sets `started` at the first."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 480, "n": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
                started.set()
    return events


def test_dp2_killed_replica_worker_fails_requests_fast_and_turns_unhealthy(tiny_llama: Path, tmp_path: Path) -> None:
    server = ServerProcess(tiny_llama, tmp_path / "server.log", "--max-model-len", "512", "--block-size", str(BLOCK),
                           "--num-kv-blocks", "200", "-dp", "2").wait_ready()
    pids = worker_pids(server.proc.pid)
    try:
        assert len(pids) == 2
        flags = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:  # one long request on each replica (idle replicas take turns)
            running = [pool.submit(stream_events, server, [5 + i, 6, 7, 8], flags[i]) for i in range(2)]
            assert all(f.wait(60) for f in flags)
            os.kill(pids[0], signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=60) for f in running]
        assert time.monotonic() - killed < 15
        errors = [e["error"] for events in results for e in events if "error" in e]
        assert len(errors) == 1, errors  # the other replica's request finishes
        assert errors[0]["code"] == "unavailable", errors
        assert re.search(r"data-parallel replica \d failed: RuntimeError", errors[0]["message"]), errors
        deadline = time.monotonic() + 10
        while server.health().status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        health = server.health()
        assert health.status_code == 503 and "data-parallel replica" in health.json()["error"]["message"], health.text
        r = complete(server, [1, 2, 3])  # new requests are refused, naming the replica
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert re.search(r"data-parallel replica \d of 2 failed \(RuntimeError\); the server is unhealthy",
                         r.json()["error"]["message"]), r.text
        assert "rank 0" in server.log() and "SIGKILL" in server.log()  # the operator's log names the cause
    finally:
        assert server.terminate(timeout=60) == 0, server.log()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "a worker outlived the server"


def test_dp0_exits_2_before_loading(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portside.cli import main  # in this process: another interpreter costs ~10 s of imports on CI's 2 cores

    code = main(["serve", str(tiny_llama), "--device", "cpu", "-dp", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "data_parallel_size must be an integer of at least 1, got 0" in err
    assert "Traceback" not in err and "portside: serving" not in err


def test_dp2_adapters_loaded_and_unloaded_at_run_time_reach_both_replicas(tiny_llama: Path, tmp_path: Path) -> None:
    """An adapter loaded over HTTP serves its transformers + peft tokens on both replicas; unloaded,
    neither serves it."""
    from test_lora_serving import peft_greedy  # the peft oracle of the LoRA server tests
    from transformers import AutoTokenizer

    from portside.testing.tiny import make_tiny_lora

    adapter = make_tiny_lora(tiny_llama, tmp_path / "late", r=8, seed=13)
    server = ServerProcess(tiny_llama, tmp_path / "server.log", "--max-model-len", "256", "--block-size", str(BLOCK),
                           "--num-kv-blocks", "200", "-dp", "2", "--enable-lora", "--max-lora-rank", "8",
                           "--allow-runtime-lora-updating").wait_ready()
    try:
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        prompts = [[5 + i, 17, 42, 9, 33, 8] for i in range(4)]  # shorter than a block: spread by load
        body = {"model": "late", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda p: post(server, "/v1/completions", body | {"prompt": p}), prompts))
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        for p, resp in zip(prompts, responses, strict=True):
            assert resp.status_code == 200, resp.text
            validate("CreateCompletionResponse", resp.json())
            want = [tok.decode([t]) for t in peft_greedy(tiny_llama, adapter, p, 8)]
            assert resp.json()["choices"][0]["logprobs"]["tokens"] == want
        done = by_engine(server, "vllm:request_success_total")
        assert min(done.values()) > 0, done  # both replicas ran the adapter
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
        gone = post(server, "/v1/completions", body | {"prompt": prompts[0]})
        assert gone.status_code == 404, gone.text
    finally:
        assert server.terminate() == 0, server.log()[-3000:]
