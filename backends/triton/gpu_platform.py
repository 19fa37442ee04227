"""What the cuda and rocm platforms share: torch exposes both as the ``cuda`` device type.

`TorchGpuPlatform` implements the device methods, the configuration hook, the parts (Triton
attention and fused MoE, device graphs, torch.distributed collectives) and the probe's common
steps; the cuda and rocm packages subclass it with their identity and their build check. It
lives in the shared Triton package because a backend never imports another backend's module.
Importing it imports neither triton nor the CUDA runtime.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from portside.backends.triton.graphs import (
    GRAPH_SIZES_OPTION,
    DeviceGraphRunner,
    default_graph_sizes,
    parse_graph_sizes,
    with_graph_sizes,
)
from portside.contract import (
    AttentionBackend,
    Availability,
    BackendOption,
    Communicator,
    DeviceInfo,
    GraphRunner,
    ModelFn,
    ModelOps,
    Platform,
    Sampler,
    SingleRankCommunicator,
    TorchDistributedCommunicator,
)

if TYPE_CHECKING:
    from portside.config import EngineConfig

__all__ = ["TorchGpuPlatform", "gpu_availability", "update_gpu_config", "BACKEND_OPTIONS"]

ENFORCE_EAGER_OPTION = "enforce_eager"  # "1"/"true": no graphs
BACKEND_OPTIONS = (
    BackendOption(GRAPH_SIZES_OPTION, "decode batch sizes captured as CUDA/HIP graphs, comma-separated (empty: none); "
                  "default: powers of two up to max_num_seqs (at most 512)"),
    BackendOption(ENFORCE_EAGER_OPTION, "1: capture no graphs (what --enforce-eager sets)", ("0", "1", "false", "true", "no", "yes"),
                  "0"),
)


def gpu_availability(build_error: str | None, has_triton: bool, device_count: int, no_device: str) -> Availability:
    """The probe's decision from its facts, in the order a user should fix them."""
    if build_error:
        return Availability.no(build_error)
    if not has_triton:
        return Availability.no("triton is not installed (pip install 'portside[cuda]' or 'portside[rocm]')")
    if device_count <= 0:
        return Availability.no(no_device)
    return Availability.yes()


def update_gpu_config(config: EngineConfig, platform_name: str, bf16_supported: bool) -> EngineConfig:
    """The GPU-specific part of `check_and_update_config`, as a pure function.

    Rejects bf16 on devices without it, and records the decode-graph buckets (option
    ``graph_sizes``; empty with ``enforce_eager=1``) in the returned config (the options' keys and
    choices are checked before, against `BACKEND_OPTIONS`).
    """
    options = dict(config.platform_options)
    if config.model.dtype == torch.bfloat16 and not bf16_supported:
        raise ValueError(f"this {platform_name} device does not support bfloat16; use dtype float16")
    max_seqs = config.scheduler.max_num_seqs
    if options.get(ENFORCE_EAGER_OPTION, "0").lower() in ("1", "true", "yes"):
        sizes: tuple[int, ...] = ()
    elif GRAPH_SIZES_OPTION in options:
        sizes = tuple(s for s in parse_graph_sizes(options[GRAPH_SIZES_OPTION]) if s <= max_seqs)
    else:
        sizes = default_graph_sizes(max_seqs)
    return with_graph_sizes(config, sizes)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


class TorchGpuPlatform(Platform):
    """Base of the cuda and rocm platforms (not registered itself)."""

    device_type = "cuda"
    host_device = False
    worker_start_method = "spawn"  # forking from a server is unverified with the CUDA/HIP runtimes
    ray_resource = "GPU"
    dist_backend = "nccl"  # RCCL answers to this name on ROCm builds of torch
    block_sizes: ClassVar[tuple[int, ...]] = (16, 32, 64)
    default_block_size = 16
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")  # TritonAttentionBackend's
    attention_name = "triton"
    communicator_cls: ClassVar[type[TorchDistributedCommunicator]] = TorchDistributedCommunicator
    graph_runner_cls: ClassVar[type[DeviceGraphRunner]] = DeviceGraphRunner
    eager_options: ClassVar[dict[str, str] | None] = {ENFORCE_EAGER_OPTION: "1"}  # --enforce-eager: no CUDA/HIP graphs
    backend_options: ClassVar[tuple[BackendOption, ...]] = BACKEND_OPTIONS
    priority = 100
    no_device: ClassVar[str] = "no GPU visible"
    """`is_available`'s reason when the build is right but no device is visible: what to check."""

    @classmethod
    def build_error(cls) -> str | None:
        """Why this torch build cannot drive the platform's GPUs, or None (each subclass's check)."""
        raise NotImplementedError

    @classmethod
    def visible_devices(cls) -> int:
        """Devices visible to this process: the runtime's count (the HIP runtime's on ROCm)."""
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @classmethod
    def is_available(cls) -> Availability:
        """The build, then triton, then a visible device (`gpu_availability`); never creates a context."""
        build_error = cls.build_error()
        return gpu_availability(
            build_error,
            has_triton=build_error is not None or has_triton(),
            device_count=0 if build_error else cls.visible_devices(),
            no_device=cls.no_device,
        )

    @classmethod
    def device_info(cls) -> DeviceInfo:
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return DeviceInfo(
            name=torch.cuda.get_device_name(index), count=torch.cuda.device_count(), total_memory=total, free_memory=free
        )

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    @classmethod
    def synchronize(cls) -> None:
        torch.cuda.synchronize()

    @classmethod
    def seed(cls, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA device too

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The checkpoint's dtype; bf16 becomes fp16 on devices without bf16 (pre-Ampere)."""
        if checkpoint_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float16
        return super().auto_dtype(checkpoint_dtype)

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> EngineConfig:
        config = super().check_and_update_config(config)
        bf16 = config.model.dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()
        return update_gpu_config(config, cls.name, bf16)

    @classmethod
    def attention_backend(cls, config: EngineConfig) -> AttentionBackend:
        from portside.backends.triton.attention import TritonAttentionBackend  # imports triton

        return TritonAttentionBackend()

    @classmethod
    def model_ops(cls, config: EngineConfig) -> ModelOps:
        from portside.backends.triton.moe import TritonModelOps  # imports triton

        return TritonModelOps()

    @classmethod
    def sampler(cls, config: EngineConfig) -> Sampler:
        """Core's sampler with the Triton grammar mask (`sampling.py`) for structured output."""
        from portside.backends.triton.sampling import apply_token_bitmask  # imports triton

        return Sampler(apply_token_bitmask=apply_token_bitmask)

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config: EngineConfig) -> GraphRunner:
        return cls.graph_runner_cls(model_fn, config)

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return SingleRankCommunicator()
        return cls.communicator_cls(group)
