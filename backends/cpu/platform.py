"""CpuPlatform: runs anywhere torch does."""

from __future__ import annotations

import logging
import platform as _platform
from functools import lru_cache
from typing import ClassVar

import torch

from portside.backend_api import (
    AttentionBackend,
    Availability,
    DeviceInfo,
    GraphRunner,
    ModelFn,
    Platform,
)

logger = logging.getLogger(__name__)

from portside.backends.cpu.graph import GRAPH_MODES  # noqa: E402  (cheap: torch only)


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


def _meminfo() -> tuple[int, int]:
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key == "MemTotal":
                    total = int(value.split()[0]) * 1024
                elif key == "MemAvailable":
                    avail = int(value.split()[0]) * 1024
    except OSError:
        pass
    return total, avail


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    block_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64, 128)
    default_block_size = 16
    default_kv_cache_memory = 4 * 2**30  # bytes, like vLLM's CPU default; capped by free memory
    attention_name = "torch-sdpa"
    graph_name = "eager|inductor|openvino"
    collectives_name = "gloo"

    @classmethod
    def is_available(cls) -> Availability:
        return Availability.yes()

    @classmethod
    def device_info(cls) -> DeviceInfo:
        total, avail = _meminfo()
        isa = "AVX-512" if "avx512f" in cpu_flags() else ("AVX2" if "avx2" in cpu_flags() else "baseline")
        name = f"{_platform.machine()} CPU ({isa}, {torch.get_num_threads()} threads)"
        return DeviceInfo(name=name, count=1, total_memory=total, free_memory=avail)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if checkpoint_dtype in (torch.bfloat16, torch.float16) and not has_native_bf16():
            logger.info("dtype auto -> float32: this CPU has no native bf16/fp16 matmul (AVX-512-BF16/AMX)")
            return torch.float32
        return checkpoint_dtype

    @classmethod
    def check_and_update_config(cls, config):
        mode = config.option("cpu_graph", "eager")
        if mode not in GRAPH_MODES:
            raise ValueError(f"unknown cpu graph mode {mode!r}; use one of {list(GRAPH_MODES)}")
        return super().check_and_update_config(config)

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        from portside.backends.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config) -> GraphRunner:
        from portside.backends.cpu.graph import make_graph_runner

        return make_graph_runner(model_fn, config)
