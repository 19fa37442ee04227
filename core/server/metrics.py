"""Prometheus metrics for `GET /metrics`.

Per-request figures (outcomes, latency histograms) are observed from the async engine's
`RequestRecord`s; engine-wide figures (running/waiting, KV-cache and prefix-cache use, token
totals, preemptions) are read from the engine's latest `EngineStats` snapshot at scrape time.
Each app gets its own registry, so several servers can live in one process (tests). The same
figures are also exported under vLLM's names (`portside.server.vllm_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from portside.engine.stats import RequestRecord
from portside.server.kv_transfer_metrics import kv_transfer_metrics
from portside.server.vllm_metrics import VllmMetrics

disable_created_metrics()  # no `_created` series: they double the exposition for little use

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    """Engine-wide gauges and counters, read from `stats()` (an `EngineStats` or None)."""

    def __init__(self, stats: Callable[[], Any], num_waiting: Callable[[], int]) -> None:
        self._stats = stats
        self._num_waiting = num_waiting

    def collect(self) -> Iterator[Any]:
        s = self._stats()

        def get(name: str) -> float:
            return float(getattr(s, name, 0) or 0) if s is not None else 0.0

        yield _gauge("portside_num_requests_running", "Requests in the engine's running batch.", get("num_running"))
        # the engine's waiting queue plus requests accepted by the server but not yet scheduled
        yield _gauge("portside_num_requests_waiting", "Requests waiting to be scheduled.", max(get("num_waiting"), float(self._num_waiting())))
        yield _gauge("portside_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", get("kv_cache_usage"))
        yield _gauge("portside_kv_cache_used_blocks", "KV-cache blocks in use by requests.", get("num_used_blocks"))
        yield _gauge("portside_kv_cache_total_blocks", "KV-cache blocks in the pool.", get("num_total_blocks"))
        queries, hits = get("prefix_cache_queries"), get("prefix_cache_hits")
        yield _counter("portside_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield _counter("portside_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield _gauge("portside_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start.", hits / queries if queries else 0.0)
        yield _counter("portside_num_preemptions", "Requests preempted (recomputed later) since start.", get("num_preemptions"))
        yield _counter("portside_prompt_tokens", "Prompt tokens processed since start.", get("prompt_tokens_total"))
        yield _counter("portside_generation_tokens", "Tokens generated since start.", get("generation_tokens_total"))
        yield _gauge("portside_model_weight_bytes", "Bytes of the loaded model weights (all ranks; quantized where the model is).", get("weight_bytes"))
        yield from kv_transfer_metrics(getattr(s, "kv_transfer", None))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The server's Prometheus registry."""

    def __init__(self, stats: Callable[[], Any], num_waiting: Callable[[], int], model_name: str = "",
                 max_model_len: int = 2048, engine_stats: Callable[[], list[Any]] | None = None,
                 num_engines: int = 1) -> None:
        """`stats`: the engine's `EngineStats` (summed over data-parallel replicas) for the
        `portside_*` series; `engine_stats`: one per replica (default: `[stats()]`) for the
        `vllm:*` series, labelled `engine="i"` as vLLM's."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("portside_requests", "Generation requests by outcome.", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros from the start
        self.ttft = Histogram(
            "portside_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "portside_time_per_output_token_seconds", "Mean time per generated token after the first, per request.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "portside_e2e_request_latency_seconds", "Time from arrival to the end of the request.",
            buckets=_E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(stats, num_waiting))
        per_engine = engine_stats if engine_stats is not None else (lambda: [stats()])
        self.vllm = VllmMetrics(self.registry, model_name, max_model_len, per_engine, num_engines)

    def observe_step(self, stats: Any, engine_index: int = 0) -> None:
        """Account for one engine step (the async engine's `on_step`) of replica `engine_index`."""
        self.vllm.observe_step(stats, engine_index)

    def observe(self, record: RequestRecord) -> None:
        """Account for one ended request (the async engine's `on_request_done`)."""
        self.vllm.observe(record)
        self.requests.labels(record.outcome if record.outcome in OUTCOMES else "error").inc()
        if record.outcome in ("stop", "length"):
            if record.ttft is not None:
                self.ttft.observe(record.ttft)
            if record.tpot is not None:
                self.tpot.observe(record.tpot)
            self.e2e.observe(record.e2e)

    def rejected(self) -> None:
        """A generation request refused before it reached the engine (bad input, queue full)."""
        self.requests.labels("rejected").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
