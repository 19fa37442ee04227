"""Operator output: the per-request log line, the periodic stats line, their flags, and
OpenTelemetry tracing (in-memory exporter, no network)."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest
from server_process import ServerProcess

from portside.engine.stats import EngineStats
from portside.server.request_log import StatsLogger

LINE = re.compile(r"INFO portside\.requests: (request_id=\S+ .*)")


def _fields(line: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in line.split())


def _request_line(log: str, request_id: str) -> dict[str, str] | None:
    for m in LINE.finditer(log):
        fields = _fields(m.group(1))
        if fields["request_id"] == request_id:
            return fields
    return None


def test_one_line_per_finished_request_at_the_default_log_level(server, client) -> None:  # type: ignore[no-untyped-def]
    secret = "zebra umbrella marmalade"
    r = client.completions.create(model="tiny", prompt=secret, max_tokens=6, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while (fields := _request_line(server.log(), r.id)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fields is not None, server.log()[-2000:]
    assert list(fields) == ["request_id", "model", "finish_reason", "prompt_tokens", "output_tokens", "ttft_s", "queue_s",
                            "e2e_s"]
    assert fields["model"] == "tiny" and fields["finish_reason"] == "length"
    assert int(fields["prompt_tokens"]) == r.usage.prompt_tokens and int(fields["output_tokens"]) == 6
    assert 0 <= float(fields["queue_s"]) <= float(fields["ttft_s"]) <= float(fields["e2e_s"])
    assert secret not in server.log() and r.choices[0].text not in server.log()  # never the text, only counts


def _stats(prompt: int, generated: int, running: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=0, kv_cache_usage=0.25, num_used_blocks=4, num_total_blocks=16,
                       prefix_cache_queries=prompt, prefix_cache_hits=prompt // 2, num_preemptions=0,
                       prompt_tokens_total=prompt, generation_tokens_total=generated)  # fmt: skip


def test_stats_line_only_when_there_was_activity(caplog: pytest.LogCaptureFixture) -> None:
    current = [_stats(0, 0)]
    logger = StatsLogger(lambda: current[0], interval=10.0)
    caplog.set_level(logging.INFO, logger="portside.stats")
    assert not logger.log_once()  # idle: nothing
    current[0] = _stats(100, 40, running=2)
    assert logger.log_once()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "portside.stats"]
    assert re.fullmatch(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                        r"Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25\.0%, Prefix cache hit rate: 50\.0%", line)
    current[0] = _stats(100, 40)
    assert not logger.log_once()  # nothing new and nothing running


def test_serve_flags_map_to_the_server_config() -> None:
    from portside.cli import build_parser
    from portside.server.main import server_config

    on = server_config(build_parser().parse_args(["serve"]))
    assert on.log_requests and on.log_stats and on.otlp_traces_endpoint is None
    off = server_config(build_parser().parse_args(["serve", "--disable-log-requests", "--disable-log-stats"]))
    assert not off.log_requests and not off.log_stats


def test_otlp_endpoint_without_opentelemetry_exits_2_naming_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from portside.cli import main

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if opentelemetry-sdk were not installed
    assert main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4317"]) == 2
    assert "pip install opentelemetry-sdk opentelemetry-exporter-otlp" in capsys.readouterr().err


@pytest.fixture
def fresh_engine(tiny_llama: Path):  # type: ignore[no-untyped-def]
    from portside.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=128, block_size=16,
                               num_kv_blocks=64)  # fmt: skip


def test_a_span_per_request_with_vllm_attributes(fresh_engine) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("opentelemetry.sdk.trace")
    from fastapi.testclient import TestClient
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from portside.server.app import ServerConfig, build_app

    exporter = InMemorySpanExporter()
    app = build_app(fresh_engine, ServerConfig(served_model_names=["tiny"], span_exporter=exporter, log_stats=False))
    with TestClient(app) as c:
        body = c.post("/v1/completions", json={"model": "tiny", "prompt": "trace me", "max_tokens": 5, "temperature": 0.5,
                                               "ignore_eos": True}).json()  # fmt: skip
    (span,) = exporter.get_finished_spans()  # the app's shutdown flushed it
    a = span.attributes
    assert span.name == "llm_request" and span.kind is SpanKind.SERVER
    assert a["gen_ai.request.id"] == body["id"] and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"] and a["gen_ai.usage.completion_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 1
    assert 0 <= a["gen_ai.latency.time_in_queue"] < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    phases = a["gen_ai.latency.time_in_queue"] + a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"]
    assert phases == pytest.approx(a["gen_ai.latency.e2e"], abs=1e-6)
    assert span.end_time - span.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=1e5)
    assert abs(span.end_time / 1e9 - time.time()) < 60  # wall-clock times


def test_disable_log_requests_silences_the_request_line(fresh_engine, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from portside.server.app import ServerConfig, build_app

    caplog.set_level(logging.INFO, logger="portside.requests")
    app = build_app(fresh_engine, ServerConfig(served_model_names=["tiny"], log_requests=False, log_stats=False))
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "quiet", "max_tokens": 3}).status_code == 200
    assert not [r for r in caplog.records if r.name == "portside.requests"]


@pytest.mark.slow
def test_serve_prints_request_and_stats_lines_and_the_flags_silence_them(tiny_llama: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    monkeypatch.setenv("PORTSIDE_LOG_STATS_INTERVAL", "0.3")
    args = ("--max-model-len", "128", "--block-size", "16", "--num-kv-blocks", "64")
    loud = ServerProcess(tiny_llama, tmp_path / "loud.log", *args)
    quiet = ServerProcess(tiny_llama, tmp_path / "quiet.log", *args, "--disable-log-requests", "--disable-log-stats")
    try:
        for proc in (loud.wait_ready(), quiet.wait_ready()):
            r = httpx.post(proc.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 40, "ignore_eos": True})
            assert r.status_code == 200, r.text
        time.sleep(1.0)  # past a few stats intervals
        assert "INFO portside.requests: request_id=" in loud.log()
        assert "INFO portside.stats: Avg prompt throughput" in loud.log()
        count = loud.log().count("portside.stats:")
        time.sleep(1.0)  # idle now: no more stats lines
        assert loud.log().count("portside.stats:") == count
        assert "portside.requests" not in quiet.log() and "portside.stats" not in quiet.log()
    finally:
        loud.kill()
        quiet.kill()


def test_default_level_shows_the_lines_and_a_quieter_level_hides_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from portside.server.request_log import show_at_default_level

    root = logging.getLogger()
    for level, shown in ((logging.WARNING, True), (logging.ERROR, False)):
        log = logging.getLogger(f"portside.test_level_{level}")
        monkeypatch.setattr(root, "level", level)
        show_at_default_level(log)
        assert log.isEnabledFor(logging.INFO) is shown, logging.getLevelName(level)
        for h in list(log.handlers):
            log.removeHandler(h)
