"""KV connectors by name: each is a scheduler half (`KVConnectorScheduler`, pure Python) and a
worker half (`portside.runner.kv_transfer.KVConnectorWorker`), given as "module:Class" paths so
that the scheduler's process never imports the worker half (torch) and vice versa."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from portside.kv_transfer.base import KVTransferInfo

__all__ = ["CONNECTORS", "register_connector", "connector_class", "make_scheduler_connector"]

# name -> (scheduler half, worker half)
CONNECTORS: dict[str, tuple[str, str]] = {
    "tiers": ("portside.kv_transfer.tiers:TiersScheduler", "portside.runner.kv_tiers:TiersWorker"),
    "shared_storage": ("portside.kv_transfer.shared_storage:SharedStorageScheduler",
                       "portside.runner.kv_shared_storage:SharedStorageWorker"),
}


def register_connector(name: str, scheduler_cls: str, worker_cls: str) -> None:
    """Add (or replace) a connector: its two halves as "module:Class" paths."""
    CONNECTORS[name] = (scheduler_cls, worker_cls)


def connector_class(name: str, half: str) -> Any:
    """The class of connector `name`'s "scheduler" or "worker" half."""
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(sorted(CONNECTORS))}")
    path = CONNECTORS[name][0 if half == "scheduler" else 1]
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_scheduler_connector(config: Any, block_size: int, info: Callable[[], Any], num_state_slots: int = 0) -> Any:
    """The scheduler half of `config.kv_transfer`'s connector (`config`: the `EngineConfig`), or
    None without one. `info()` asks the workers for their `KVTransferInfo` (block bytes,
    fingerprint): one, or a list of every rank's, by rank (combined: `KVTransferInfo.combine`).
    Refuses what the connectors cannot keep yet, naming it.

    A sliding-window model is kept like any other (it needs no parameter here): its prefix cache enters every
    full block in the cache, those that fell out of the window included (they are cached before
    they are freed, and a freed block's KV stays intact until the pool hands it out again, when
    `on_evict` saves it), a hit is a chain of cached blocks from the first, and a table's null
    placeholders have no hash, so no connector ever saves or loads one."""
    kvt = config.kv_transfer
    if kvt is None:
        return None
    what = "the KV connector" if kvt.connector != "tiers" else "the KV tiers (--kv-offload-*, --preemption-mode swap)"
    if not config.cache.enable_prefix_caching:
        raise ValueError(f"{what} identify blocks by their prefix-cache hash; enable prefix caching")
    if num_state_slots:
        raise ValueError(f"{what}: a model with recurrent layers keeps state outside the KV blocks; not supported yet")
    cls = connector_class(kvt.connector, "scheduler")
    infos = info()
    return cls(kvt, block_size, KVTransferInfo.combine(infos) if isinstance(infos, list) else infos)
