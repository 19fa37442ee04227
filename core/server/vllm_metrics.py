"""The server's figures under vLLM's Prometheus names (`vllm:*`), so vLLM's Grafana dashboards
and autoscalers read a portside server unchanged.

Names, types, buckets and labels follow vLLM's v1 engine: every series has `model_name` (the
first served model name) and `engine` (the data-parallel replica: "0" .. "D-1"; "0" alone
without data parallelism). Per-request histograms and
`vllm:request_success_total` are observed from the async engine's `RequestRecord`s, per-step
histograms (tokens per step, inter-token latency) from each step's `EngineStats`, and gauges and
engine-wide counters are read from the latest `EngineStats` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from portside.engine.stats import RequestRecord

LABELS = ["model_name", "engine"]
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """The `vllm:*` series in `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 engine_stats: Callable[[], list[Any]], num_engines: int = 1) -> None:
        """`engine_stats`: the latest `EngineStats` of each of the `num_engines` replicas."""
        self.engine_labels = [(model_name, str(i)) for i in range(num_engines)]
        r = registry

        def hist(name: str, doc: str, buckets: Any) -> list[Any]:  # one child per engine
            family = Histogram(name, doc, LABELS, buckets=buckets, registry=r)
            return [family.labels(*labels) for labels in self.engine_labels]

        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               LABELS + ["finished_reason"], registry=r)
        for labels in self.engine_labels:
            for reason in FINISHED_REASONS:
                self.success.labels(*labels, reason)  # export zeros from the start
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                      tokens)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        TOKEN_LATENCY_BUCKETS)
        # the pre-0.11 name of the same observations, still read by older dashboards
        self.tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                         TOKEN_LATENCY_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        latency = REQUEST_LATENCY_BUCKETS
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          latency)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", latency)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                            latency)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           latency)
        r.register(_EngineCollector(engine_stats, self.engine_labels))

    def observe(self, record: RequestRecord) -> None:
        """Account for one ended request (under its replica's `engine` label)."""
        e = record.engine_index if 0 <= record.engine_index < len(self.engine_labels) else 0
        if record.outcome in FINISHED_REASONS:
            self.success.labels(*self.engine_labels[e], record.outcome).inc()
        if record.outcome not in ("stop", "length"):  # an abort's timings are the client's
            return
        self.prompt_tokens[e].observe(record.num_prompt_tokens)
        self.generation_tokens[e].observe(record.num_generation_tokens)
        if record.params is not None:
            self.params_n[e].observe(record.params.n)
            if record.params.max_tokens is not None:
                self.params_max_tokens[e].observe(record.params.max_tokens)
        self.e2e[e].observe(record.e2e)
        for histogram, value in ((self.ttft, record.ttft), (self.request_tpot, record.tpot), (self.queue, record.queue_time),
                                 (self.prefill, record.prefill_time), (self.decode, record.decode_time)):
            if value is not None:
                histogram[e].observe(value)
        if record.prefill_time is not None and record.decode_time is not None:
            self.inference[e].observe(record.prefill_time + record.decode_time)

    def observe_step(self, stats: Any, engine_index: int = 0) -> None:
        """Account for one step (its `EngineStats`) of replica `engine_index`."""
        e = engine_index if 0 <= engine_index < len(self.engine_labels) else 0
        if getattr(stats, "step_tokens", 0):
            self.iteration_tokens[e].observe(stats.step_tokens)
        for interval in getattr(stats, "token_intervals", ()):
            self.itl[e].observe(interval)
            self.tpot[e].observe(interval)


# the series read from each replica's latest EngineStats: (family, name, help, EngineStats field)
_ENGINE_SERIES = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    (GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
     "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.", "kv_cache_usage"),
    (CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    (CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
    (CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"),
)


class _EngineCollector(Collector):
    """Gauges and engine-wide counters from each replica's latest `EngineStats` (or zeros before
    the first), one sample per `engine` label."""

    def __init__(self, engine_stats: Callable[[], list[Any]], engine_labels: list[tuple[str, str]]) -> None:
        self._engine_stats = engine_stats
        self._labels = [list(labels) for labels in engine_labels]

    def collect(self) -> Iterator[Any]:
        stats = list(self._engine_stats())
        stats += [None] * (len(self._labels) - len(stats))

        for kind, name, doc, attr in _ENGINE_SERIES:  # one sample per replica
            f = kind(name, doc, labels=LABELS)
            for labels, s in zip(self._labels, stats):
                f.add_metric(labels, float(getattr(s, attr, 0) or 0) if s is not None else 0.0)
            yield f
        yield from self._spec_decode([getattr(s, "spec_decode", None) for s in stats])

    def _spec_decode(self, specs: list[Any]) -> Iterator[Any]:
        """Speculative decoding counters, as vLLM's (zeros without speculation)."""
        for name, attr, doc in (
            ("vllm:spec_decode_num_drafts", "num_drafts", "Number of spec decoding drafts."),
            ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Number of draft tokens."),
            ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Number of accepted tokens."),
        ):
            f = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, spec in zip(self._labels, specs):
                f.add_metric(labels, float(getattr(spec, attr, 0)))
            yield f
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for labels, spec in zip(self._labels, specs):
            for pos, n in enumerate(getattr(spec, "num_accepted_tokens_per_pos", [])):
                per_pos.add_metric([*labels, str(pos)], float(n))
        yield per_pos
