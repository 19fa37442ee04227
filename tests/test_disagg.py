"""Disaggregated prefill and decode through the shared-storage KV connector: a producer engine
saves a prompt's blocks, a consumer engine loads them instead of computing them, and the greedy
tokens equal one engine's; a damaged or missing block file costs a recompute, never wrong tokens.
The end-to-end case runs two `portside serve` processes behind `portside disagg-proxy` and drives
them with the `openai` client, streaming included."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from portside.kv_transfer.shared_storage import resolve_disagg_flags

BS = 4
ENGINE = dict(device="cpu", max_model_len=128, block_size=BS, num_kv_blocks=64)


def _prompt(seed: int, n: int = 41) -> list[int]:
    return [(seed * 31 + 7 * i) % 400 + 5 for i in range(n)]


def _run(engine: Any, prompt: list[int], max_tokens: int) -> list[int]:
    from portside.sampling_params import SamplingParams

    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                         ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def _block_files(path: Path) -> list[Path]:
    return sorted(path.glob("portside-kv-*/*.kvb"))


def test_flags_follow_vllm_and_portside_names() -> None:
    assert resolve_disagg_flags() is None
    cfg = '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda", ' \
          '"kv_connector_extra_config": {"shared_storage_path": "/x"}}'
    assert resolve_disagg_flags(cfg) == ("shared_storage", "producer", (("path", "/x"),))
    assert resolve_disagg_flags(cfg, kv_role="consumer", kv_connector_path="/y") == ("shared_storage", "consumer",
                                                                                     (("path", "/y"),))
    assert resolve_disagg_flags(None, None, "shared_storage", "/z") == ("shared_storage", "both", (("path", "/z"),))
    with pytest.raises(ValueError, match="NixlConnector.*not available"):
        resolve_disagg_flags('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="need --kv-connector shared_storage"):
        resolve_disagg_flags(None, kv_role="producer")
    with pytest.raises(ValueError, match="unknown key"):
        resolve_disagg_flags('{"kv_conector": "SharedStorageConnector"}')
    with pytest.raises(ValueError, match="--kv-connector-path DIR"):
        resolve_disagg_flags('{"kv_connector": "SharedStorageConnector"}')
    with pytest.raises(ValueError, match="unknown KV role"):
        resolve_disagg_flags(None, "decoder", "shared_storage", "/z")


def test_the_prefill_request_asks_for_one_token_unstreamed() -> None:
    from portside.server.disagg_proxy import _prefill_body

    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 20,
            "max_completion_tokens": 20, "min_tokens": 5, "temperature": 0.0}
    assert _prefill_body(body) == {"model": "m", "prompt": "p", "max_tokens": 1, "max_completion_tokens": 1,
                                   "temperature": 0.0}
    assert body["stream"] is True and body["max_tokens"] == 20  # the decode instance gets the original


def test_connector_needs_a_path_and_is_the_only_connector(tiny_llama: Path, tmp_path: Path) -> None:
    from portside.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="--kv-connector-path DIR"):
        LLMEngine.from_args(model=str(tiny_llama), kv_connector="shared_storage", **ENGINE)
    with pytest.raises(ValueError, match="an engine runs one"):
        LLMEngine.from_args(model=str(tiny_llama), kv_connector="shared_storage", kv_connector_path=str(tmp_path),
                            kv_offload_cpu_bytes=2**20, **ENGINE)


def test_consumer_loads_what_the_producer_saved(tiny_llama: Path, tmp_path: Path) -> None:
    from portside.engine.llm_engine import LLMEngine

    store = tmp_path / "kv"
    producer = LLMEngine.from_args(model=str(tiny_llama), kv_connector="shared_storage", kv_role="producer",
                                   kv_connector_path=str(store), **ENGINE)
    consumer = LLMEngine.from_args(model=str(tiny_llama), kv_connector="shared_storage", kv_role="consumer",
                                   kv_connector_path=str(store), **ENGINE)
    try:
        prompts = [_prompt(1), _prompt(2, 23)]
        expected = [_run(producer, p, 12) for p in prompts]  # a producer computes as one engine does, and saves
        files = _block_files(store)
        assert len(files) == 41 // BS + 23 // BS  # every full prompt block, once
        assert _run(consumer, prompts[0], 12) == expected[0]
        assert consumer.scheduler.kv_loads.num_loaded_tokens == (41 - 1) // BS * BS  # all but the last token's block
        # damage the second prompt's third block: the first two are loaded, the rest recomputed
        from portside.kv_cache.hashing import hash_full_blocks
        from portside.kv_transfer.disk_format import path_of

        third = hash_full_blocks(prompts[1], BS, [])[2]
        victim = Path(path_of(str(files[0].parent), third))
        victim.write_bytes(victim.read_bytes()[:-10])  # truncated, as by a producer killed mid-write
        before = consumer.scheduler.kv_loads.num_loaded_tokens
        assert _run(consumer, prompts[1], 12) == expected[1]
        assert consumer.scheduler.kv_loads.num_loaded_tokens - before == 2 * BS
        stats = consumer.scheduler.kv_loads.connector.stats()
        assert stats["corrupt_blocks"] == 1 and stats["failed_load_blocks"] >= 1
        assert not victim.exists()  # deleted: a producer writes it again
        assert _run(consumer, prompts[1], 12) == expected[1]  # again: nothing retried, nothing loaded twice
        consumer.scheduler.kv.check_integrity()
        assert producer.scheduler.kv_loads.num_loaded_tokens == 0  # a producer never loads
    finally:
        for e in (producer, consumer):
            e.shutdown()


# ---- end to end: two servers behind the proxy --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "portside.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_two_servers_behind_the_proxy_equal_one(tiny_llama: Path, tmp_path: Path) -> None:
    import httpx
    import openai

    store = str(tmp_path / "kv")
    common = ["serve", str(tiny_llama), "--device", "cpu", "--max-model-len", "128", "--block-size", str(BS),
              "--num-kv-blocks", "64", "--host", "127.0.0.1"]
    ports = {name: _free_port() for name in ("prefill", "decode", "proxy")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = {
        "prefill": _start([*common, "--port", str(ports["prefill"]), "--kv-transfer-config",
                           '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", '
                           f'"kv_connector_extra_config": {{"shared_storage_path": "{store}"}}}}'],
                          tmp_path / "prefill.log"),
        "decode": _start([*common, "--port", str(ports["decode"]), "--kv-connector", "shared_storage", "--kv-role",
                          "consumer", "--kv-connector-path", store], tmp_path / "decode.log"),
        "proxy": _start(["disagg-proxy", "--prefill", url["prefill"], "--decode", url["decode"], "--port",
                         str(ports["proxy"]), "--timeout", "60"], tmp_path / "proxy.log"),
    }
    try:
        for name in ("prefill", "decode", "proxy"):
            _wait_healthy(url[name], procs[name], tmp_path / f"{name}.log")
        # the prefill instance computes as a single server does (a producer only saves besides): the reference
        single = openai.OpenAI(base_url=f"{url['prefill']}/v1", api_key="x")
        disagg = openai.OpenAI(base_url=f"{url['proxy']}/v1", api_key="x")
        model = single.models.list().data[0].id
        prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door"
        kw: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=16, temperature=0.0)
        want = single.completions.create(**kw).choices[0].text
        assert disagg.completions.create(**kw).choices[0].text == want
        assert list(Path(store).glob("portside-kv-*/*.kvb")), "the producer saved no block"
        # the decode instance never computed this prompt: its prefix hits are the blocks it loaded
        metrics = httpx.get(f"{url['decode']}/metrics").text
        hits = re.search(r"^portside_prefix_cache_hits(?:_total)? (\S+)$", metrics, re.M)
        assert hits is not None and float(hits.group(1)) > 0, "the decode instance loaded nothing"
        streamed = "".join(c.choices[0].text for c in disagg.completions.create(**kw, stream=True) if c.choices)
        assert streamed == want
        msgs = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm at sea."}]
        chat: dict[str, Any] = dict(model=model, messages=msgs, max_tokens=12, temperature=0.0)
        want_chat = single.chat.completions.create(**chat).choices[0].message.content
        assert disagg.chat.completions.create(**chat).choices[0].message.content == want_chat
        parts = disagg.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want_chat
        # a bad parameter: the prefill instance's 400 comes back as it is
        with pytest.raises(openai.BadRequestError):
            disagg.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=-1.0)
        # the producer dies: an OpenAI-style 502 at once, not a hang
        _stop(procs["prefill"])
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            disagg.with_options(max_retries=0).completions.create(**{**kw, "prompt": prompt + " again"})
        assert err.value.status_code == 502 and "prefill instance" in str(err.value)
        assert time.monotonic() - t0 < 30
    finally:
        for proc in procs.values():
            _stop(proc)
