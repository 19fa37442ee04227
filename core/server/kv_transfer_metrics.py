"""Prometheus series of the KV tiers and connectors (`EngineStats.kv_transfer`, from
`portside.sched.kv_loads.KVLoads.stats`), yielded by the engine collector of `portside.server.metrics`.

Per tier (label `tier`: host, disk): blocks loaded back (hits), blocks saved, bytes held and the
host tier's capacity; corrupt disk blocks dropped; the connector's transfers (loads, their
seconds and bytes, saves' seconds and bytes) from which load latency (seconds / loads) and
throughput (bytes / seconds) follow; tokens loaded instead of computed, and tokens recomputed
after preemption (fewer with --preemption-mode swap)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["kv_transfer_metrics"]


def _per_tier(family: Any, stats: dict[str, float], key: str) -> Any:
    for tier in ("host", "disk"):
        family.add_metric([tier], float(stats.get(key.format(tier=tier), 0.0)))
    return family


def kv_transfer_metrics(stats: dict[str, float] | None) -> Iterator[Any]:
    s = stats or {}

    def get(key: str) -> float:
        return float(s.get(key, 0.0))

    yield _per_tier(CounterMetricFamily("portside_kv_tier_hit_blocks", "KV blocks loaded back from a tier instead of "
                                        "recomputed.", labels=["tier"]), s, "{tier}_hit_blocks")
    yield _per_tier(CounterMetricFamily("portside_kv_tier_saved_blocks", "KV blocks written to a tier.", labels=["tier"]),
                    s, "{tier}_saved_blocks")
    yield _per_tier(GaugeMetricFamily("portside_kv_tier_bytes", "Bytes of KV blocks a tier holds.", labels=["tier"]),
                    s, "{tier}_bytes")
    yield GaugeMetricFamily("portside_kv_tier_host_capacity_bytes", "The host tier's size.", value=get("host_capacity_bytes"))
    yield CounterMetricFamily("portside_kv_tier_corrupt_blocks", "Disk-tier blocks that failed their checks: dropped and "
                              "recomputed.", value=get("corrupt_blocks"))
    yield CounterMetricFamily("portside_kv_tier_swapped_out_blocks", "Blocks of preempted requests copied to the host tier "
                              "(--preemption-mode swap).", value=get("swapped_out_blocks"))
    yield CounterMetricFamily("portside_kv_transfer_loads", "Loads (one per request and step) completed.", value=get("loads"))
    yield CounterMetricFamily("portside_kv_transfer_load_seconds", "Seconds spent loading KV blocks (latency: divide by "
                              "portside_kv_transfer_loads).", value=get("load_seconds"))
    yield CounterMetricFamily("portside_kv_transfer_load_bytes", "Bytes of KV blocks loaded.", value=get("load_bytes"))
    yield CounterMetricFamily("portside_kv_transfer_save_seconds", "Seconds spent saving KV blocks.", value=get("save_seconds"))
    yield CounterMetricFamily("portside_kv_transfer_save_bytes", "Bytes of KV blocks saved.", value=get("save_bytes"))
    seconds = get("load_seconds") + get("save_seconds")
    yield GaugeMetricFamily("portside_kv_transfer_throughput_bytes_per_second", "Bytes moved per second of transfer, "
                            "loads and saves, since start.", value=(get("load_bytes") + get("save_bytes")) / seconds if seconds else 0.0)
    yield CounterMetricFamily("portside_kv_loaded_tokens", "Prompt tokens whose KV was loaded instead of computed.",
                              value=get("loaded_tokens"))
    yield CounterMetricFamily("portside_preemption_recomputed_tokens", "Tokens computed again by resumed preempted "
                              "requests.", value=get("preemption_recomputed_tokens"))
