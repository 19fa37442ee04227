"""NpuExamplePlatform: the device `npu-example`, simulated on the CPU.

Everything a vendor must decide is a class variable or a short method here; each choice is
marked VENDOR. Heavy imports (your runtime, your kernels) belong inside the methods that build
the parts, never at module level, so that `portside devices` stays fast.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from portside.backend_api import (
    AttentionBackend,
    Availability,
    Communicator,
    DeviceInfo,
    GraphRunner,
    ModelFn,
    Platform,
    SingleRankCommunicator,
    host_memory,
)

VISIBLE_ENV = "NPU_EXAMPLE_VISIBLE_DEVICES"


class NpuExamplePlatform(Platform):
    name = "npu-example"  # the --device value; must not clash with another plugin's
    device_type = "cpu"  # VENDOR: your torch device type ("npu", "privateuseone", ...)
    dist_backend = "gloo"  # VENDOR: your torch.distributed backend ("hccl", ...)
    # VENDOR: accelerators use a positive priority so they win auto-selection over cpu (0). This
    # example is slower than the cpu backend, so it is only used when asked for by name.
    priority = -1
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    block_sizes: ClassVar[tuple[int, ...]] = (8, 16, 32)  # VENDOR: what your kernel supports
    default_block_size = 16
    default_kv_cache_memory = 512 * 2**20  # bytes
    # Shown by `portside devices` without building anything.
    attention_name = "npu-example-batched"
    graph_name = "padded-decode"
    collectives_name = "gloo"

    @classmethod
    def is_available(cls) -> Availability:
        # VENDOR: probe cheaply and say why not: look for /dev/your_npu*, your driver's shared
        # library (importlib.util.find_spec / os.path.exists), an env var. Never create a device
        # context, allocate memory or import your runtime here: `portside devices` and every
        # start of portside call this for every installed plugin.
        # The simulation reads a CUDA_VISIBLE_DEVICES-like variable: set it empty to hide the device.
        if os.environ.get(VISIBLE_ENV) == "":
            return Availability.no(f"no npu-example device visible ({VISIBLE_ENV} is empty)")
        return Availability.yes()

    @classmethod
    def device_info(cls) -> DeviceInfo:
        total, free = host_memory()  # the simulated device's memory is the host's
        return DeviceInfo(name="npu-example (simulated on the CPU)", count=1, total_memory=total, free_memory=free)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        # VENDOR: what "--dtype auto" means on your device. A real NPU would run bf16 here;
        # the simulation is on a CPU where bf16 matmuls are slow, so auto means float32.
        return torch.float32

    @classmethod
    def attention_backend(cls, config: Any) -> AttentionBackend:
        from portside_npu_example.attention import NpuExampleAttentionBackend

        return NpuExampleAttentionBackend()

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config: Any) -> GraphRunner:
        from portside_npu_example.graph import PaddedDecodeGraphRunner

        return PaddedDecodeGraphRunner(model_fn, config)

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return SingleRankCommunicator()
        from portside_npu_example.communicator import NpuExampleCommunicator

        return NpuExampleCommunicator(group)
