"""The `vllm:*` series of GET /metrics on the shared server: names, labels, and values that match
the requests sent; the Grafana dashboard in docs/grafana queries only series that exist."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "portside.json"
LABELS = {"model_name": "tiny", "engine": "0"}
NAMED = [  # every series issue 25 names, by its sample name
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:iteration_tokens_total_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]  # fmt: skip


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    """Every `vllm:` sample as (name, sorted labels) -> value."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    key = (name, tuple(sorted({**LABELS, **labels}.items())))
    assert key in samples, f"no sample {key}"
    return samples[key]


def test_every_named_series_with_model_name_and_values_that_match_the_requests(server, client) -> None:  # type: ignore[no-untyped-def]
    server.wait_idle()
    before = scrape(server)
    usages = []
    for prompt in ("one two three", "the quick brown fox jumps"):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
        usages.append(r.usage)
    chunks = list(client.completions.create(model="tiny", prompt="a streamed one", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    server.wait_idle()
    after = scrape(server)

    names = {name for name, _ in after}
    assert not [n for n in NAMED if n not in names]
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in after)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert [u.completion_tokens for u in usages] == [8, 8, 8]
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == 24
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 24
    for h in ("e2e_request_latency", "time_to_first_token", "request_queue_time", "request_prefill_time",
              "request_decode_time"):
        assert delta(f"vllm:{h}_seconds_count") == 3, h
        assert delta(f"vllm:{h}_seconds_bucket", le="+Inf") == 3, h
    for h in ("e2e_request_latency", "time_to_first_token", "request_prefill_time", "request_decode_time"):
        assert delta(f"vllm:{h}_seconds_sum") > 0, h
    # the phases tile the request: queue + prefill + decode = end to end
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    phases = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert abs(phases - e2e) <= 1e-6 + 1e-3 * e2e, (phases, e2e)
    assert 0 < delta("vllm:time_to_first_token_seconds_sum") < e2e
    # 7 intervals between the 8 tokens of each request, streamed or not
    assert delta("vllm:inter_token_latency_seconds_count") == 21
    assert delta("vllm:time_per_output_token_seconds_count") == 21
    assert delta("vllm:inter_token_latency_seconds_sum") > 0
    # each request's prompt once, then a token per step: at least 8 steps each
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + 3 * 7
    assert delta("vllm:iteration_tokens_total_count") >= 8


def test_kv_cache_usage_and_running_while_a_long_request_runs(server, client) -> None:  # type: ignore[no-untyped-def]
    server.wait_idle()
    stream = client.completions.create(model="tiny", prompt="a long one", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                break
        during = scrape(server)
    finally:
        stream.close()
    assert 0 < value(during, "vllm:kv_cache_usage_perc") <= 1
    assert value(during, "vllm:kv_cache_usage_perc") == value(during, "vllm:gpu_cache_usage_perc")
    assert value(during, "vllm:num_requests_running") == 1
    server.wait_idle()
    idle = scrape(server)
    assert value(idle, "vllm:kv_cache_usage_perc") == 0 and value(idle, "vllm:num_requests_running") == 0


def _strip(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_grafana_dashboard_queries_only_series_the_server_exports(server, client) -> None:  # type: ignore[no-untyped-def]
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["title"] and dashboard["panels"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["type"] == "query" and "model_name" in variables["model_name"]["query"]["query"]
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["type"] in ("timeseries", "heatmap", "stat", "gauge") and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'model_name="$model_name"' in target["expr"], target["expr"]
            exprs.append(target["expr"])
    # (digits too: `e2e`)
    referenced = {_strip(n) for e in exprs for n in re.findall(r"vllm:[a-z0-9_:]+", e)}
    # every series issue 25 names is on the dashboard
    assert {_strip(n) for n in NAMED} - {"vllm:time_per_output_token_seconds"} <= referenced

    client.completions.create(model="tiny", prompt="for the dashboard", max_tokens=4)
    deadline = time.monotonic() + 10
    while True:
        exported = {_strip(name) for name, _ in scrape(server)}
        missing = referenced - exported
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not missing, f"the dashboard queries series /metrics lacks: {sorted(missing)}"
