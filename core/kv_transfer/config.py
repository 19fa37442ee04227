"""`KVTransferConfig`: which KV connector an engine runs and its settings (pure Python: the
scheduler reads it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["KVTransferConfig", "KV_ROLES"]

KV_ROLES = ("producer", "consumer", "both")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (`portside.kv_transfer.base`) and its options.

    `connector`: a name in `portside.kv_transfer.factory` ("tiers": host memory and disk behind
    the device cache). `role`: what an instance does with other instances' KV (disaggregated
    prefill: a producer saves, a consumer loads, both does both). `options`: the connector's own
    settings as (key, value) strings (e.g. a shared directory)."""

    connector: str = "tiers"
    role: str = "both"
    cpu_bytes: int = 0  # host-memory tier (--kv-offload-cpu-bytes); 0: none
    disk_path: str | None = None  # disk tier's folder (--kv-offload-disk-path); None: none
    disk_bytes: int = 0  # disk tier's size (--kv-offload-disk-bytes)
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"unknown KV role {self.role!r}; use one of {', '.join(KV_ROLES)}")
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("--kv-offload-cpu-bytes and --kv-offload-disk-bytes must be >= 0")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("--kv-offload-disk-path needs --kv-offload-disk-bytes > 0 (the disk tier's size)")
        if self.disk_path is None and self.disk_bytes > 0:
            raise ValueError("--kv-offload-disk-bytes needs --kv-offload-disk-path (the disk tier's folder)")

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)


PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_SWAP_SPACE_GIB = 4.0  # vLLM's --swap-space default


def resolve_kv_transfer_config(cpu_bytes: float = 0, disk_path: str | None = None, disk_bytes: float = 0,
                               preemption_mode: str | None = None, swap_space: float | None = None,
                               connector: str | None = None, role: str | None = None,
                               options: tuple[tuple[str, str], ...] = ()) -> KVTransferConfig | None:
    """The engine's `KVTransferConfig` from its flags, or None when no connector is wanted.

    `--preemption-mode swap` needs a host tier: `--kv-offload-cpu-bytes`, else `--swap-space` GiB
    (vLLM's flag, default 4). A disk tier needs a host tier in front of it (host evictions go to disk)."""
    mode = preemption_mode or "recompute"
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"unknown preemption mode {mode!r}; use recompute or swap")
    cpu = int(cpu_bytes or 0)
    if swap_space is not None and (mode != "swap" or cpu):
        logger.warning("--swap-space has no effect: it sizes the host tier only for --preemption-mode swap without "
                       "--kv-offload-cpu-bytes")
    if mode == "swap" and cpu == 0:
        cpu = int((swap_space if swap_space is not None else DEFAULT_SWAP_SPACE_GIB) * 2**30)
    if cpu == 0 and disk_path is None and connector is None:
        return None
    if connector not in (None, "tiers") and (cpu or disk_path is not None):
        raise ValueError(f"--kv-connector {connector} and the KV tiers (--kv-offload-*, --preemption-mode swap) cannot be "
                         "combined yet: an engine runs one KV connector; drop one")
    if disk_path is not None and cpu == 0 and (connector or "tiers") == "tiers":
        raise ValueError("--kv-offload-disk-path needs --kv-offload-cpu-bytes > 0: blocks reach the disk tier "
                         "when the host tier evicts them")
    opts = options + ((("swap", "1"),) if mode == "swap" else ())
    return KVTransferConfig(connector=connector or "tiers", role=role or "both", cpu_bytes=cpu, disk_path=disk_path,
                            disk_bytes=int(disk_bytes or 0), options=opts)
