"""How many bytes the KV cache gets, from the cache config and the device's memory after loading.

- `num_kv_blocks` (exact) is handled by the caller and wins over everything here.
- `kv_cache_memory`: bytes (> 1, capped at 90% of free memory) or a fraction (<= 1) of free memory.
- `gpu_memory_utilization` (vLLM's flag): weights and KV cache together may fill that fraction of
  the device's total memory. Measured after the weights are loaded, the KV cache gets
  ``fraction x total - (total - free)``: whatever is in use by then (the weights, this process's
  buffers, other processes) counts against the fraction. On cpu, "the device" is host memory
  (total and available from /proc/meminfo), so the other processes' resident memory counts too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler side of the tree stays free of torch and the config module
    from portside.config import CacheConfig
    from portside.contract import DeviceInfo

GiB = 2**30


def kv_cache_budget(cache: CacheConfig, info: DeviceInfo, default_memory: float) -> float:
    """Bytes for the KV cache (`default_memory`: the platform's `default_kv_cache_memory`)."""
    free, total = info.free_memory, info.total_memory
    util = cache.gpu_memory_utilization
    if util is not None:
        in_use = max(0, total - free)
        budget = util * total - in_use
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {util}: {util:.0%} of {info.name}'s {total / GiB:.1f} GiB is "
                f"{util * total / GiB:.1f} GiB, but {in_use / GiB:.1f} GiB is in use after loading the model (its weights "
                "and other processes); raise the fraction, free memory, or size the cache with --kv-cache-memory"
            )
        return budget
    memory = cache.kv_cache_memory if cache.kv_cache_memory is not None else default_memory
    return memory * free if memory <= 1 else min(memory, 0.9 * free)
