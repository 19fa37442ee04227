"""What this machine offers the cpu backend: the CPU's feature flags and the cores this process may
use. A leaf of the backend (it imports no other module of it), read by the option resolution
(`options`), the native build's cache key, the kernels' dtype choices and the platform."""

from __future__ import annotations

import os
from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """AVX-512-BF16 or AMX: bf16 matmuls run at full speed. Without them they are ~100x slower."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_amx_bf16() -> bool:
    """The CPU has AMX-BF16 tiles (whether the kernel grants their state is known only once the
    native library is loaded: `native_ops.amx_unavailable_reason`)."""
    return "amx_bf16" in cpu_flags()


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), not every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
