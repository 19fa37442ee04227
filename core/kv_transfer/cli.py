"""The KV offloading flags (host and disk tiers, swap preemption) of `portside serve` / `generate`."""

from __future__ import annotations

import argparse

__all__ = ["add_kv_offload_args"]


def add_kv_offload_args(g: argparse._ArgumentGroup) -> None:
    """--kv-offload-cpu-bytes, --kv-offload-disk-path, --kv-offload-disk-bytes, --preemption-mode, --swap-space."""
    g.add_argument("--kv-offload-cpu-bytes", type=float, default=0, metavar="BYTES",
                   help="host-memory KV tier: prefix-cache blocks evicted from the device are kept here (LRU) and "
                        "loaded back on a later hit instead of recomputed; 0: off (docs/kv_tiers.md)")
    g.add_argument("--kv-offload-disk-path", default=None, metavar="DIR",
                   help="disk KV tier behind the host tier: its evictions are written here (checksummed files, LRU); a "
                        "restarted server with the same model and folder starts warm")
    g.add_argument("--kv-offload-disk-bytes", type=float, default=0, metavar="BYTES", help="the disk tier's size")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="what happens to a preempted request's KV: recompute (default) frees it; swap copies its blocks "
                        "to the host tier (--kv-offload-cpu-bytes, else --swap-space GiB) and loads them on resume")
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="vLLM's flag: the host tier's size in GiB for --preemption-mode swap when --kv-offload-cpu-bytes "
                        "is not given (default 4); no effect otherwise")
