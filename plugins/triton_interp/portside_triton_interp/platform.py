"""TritonInterpPlatform: the device `triton-interp` (CPU tensors, Triton kernels interpreted).

Written against `portside.backend_api` only, plus the shared Triton kernel package
(`portside.backends.triton`), which is imported inside `attention_backend`: the probe and
`portside devices` never import triton.

Parts:
- attention: `TritonAttentionBackend`, the kernels the cuda and rocm platforms launch;
- graph: `EagerGraphRunner` (the `Platform.graph_runner` default). The shared device-graph runner records ``torch.cuda`` graphs,
  which CPU tensors cannot be captured into; the kernels' graph-safety (no host reads of
  per-request values) is covered by the cuda leg;
- collectives: torch.distributed over gloo (the `Platform.communicator` default);
- model ops: `TritonModelOps`, the cuda/rocm fused-MoE kernel.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, ClassVar

import torch

from portside.backend_api import AttentionBackend, Availability, DeviceInfo, ModelOps, Platform, host_memory

INTERPRET_ENV = "TRITON_INTERPRET"


class TritonInterpPlatform(Platform):
    """CPU tensors, Triton kernels run by the interpreter. Used only when asked for by name."""

    name = "triton-interp"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -1  # slower than the cpu backend: never auto-selected
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    block_sizes: ClassVar[tuple[int, ...]] = (16, 32, 64)  # the Triton kernels' block sizes
    default_block_size = 16
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")  # the Triton kernels' fp8 caches
    default_kv_cache_memory = 512 * 2**20  # bytes
    attention_name = "triton (interpreter)"
    graph_name = "eager"
    collectives_name = "gloo"

    @classmethod
    def is_available(cls) -> Availability:
        if os.environ.get(INTERPRET_ENV) != "1":
            return Availability.no(f"runs Triton kernels on CPU tensors only in the interpreter: set {INTERPRET_ENV}=1")
        if importlib.util.find_spec("triton") is None:
            return Availability.no("triton is not installed (pip install 'portside[triton]')")
        return Availability.yes()

    @classmethod
    def device_info(cls) -> DeviceInfo:
        total, free = host_memory()  # the simulated device's memory is the host's
        return DeviceInfo(name="CPU (Triton interpreter)", count=1, total_memory=total, free_memory=free)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # CPU matmuls in reduced precision are slow; parity checks want fp32

    @classmethod
    def attention_backend(cls, config: Any) -> AttentionBackend:
        from portside.backends.triton.attention import TritonAttentionBackend  # imports triton

        return TritonAttentionBackend()

    @classmethod
    def model_ops(cls, config: Any) -> ModelOps:
        from portside.backends.triton.moe import TritonModelOps  # imports triton

        return TritonModelOps()
