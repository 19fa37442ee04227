"""CudaPlatform: NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

from typing import ClassVar

import torch

from portside.backends.cuda.communicator import NcclCommunicator
from portside.backends.cuda.graph import CudaGraphRunner
from portside.backends.triton.gpu_platform import TorchGpuPlatform

__all__ = ["CudaPlatform", "cuda_build_error", "visible_cuda_devices"]


def cuda_build_error(cuda_version: str | None, hip_version: str | None) -> str | None:
    """Why this torch build cannot drive NVIDIA GPUs, or None."""
    if hip_version is not None:
        return f"this torch build targets ROCm (HIP {hip_version}), not CUDA; use --device rocm"
    if cuda_version is None:
        return "this torch build has no CUDA support (CPU-only wheel)"
    return None


def visible_cuda_devices() -> int:
    """NVIDIA devices visible to this process, counted through NVML so no CUDA context is
    created (and fork stays safe); falls back to the CUDA runtime count when NVML fails."""
    count_nvml = getattr(torch.cuda, "_device_count_nvml", None)  # private, present since torch 2.1
    if count_nvml is not None:
        try:
            count = count_nvml()
        except Exception:  # noqa: BLE001 - NVML missing or broken: fall back
            count = -1
        if count >= 0:
            return count
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CudaPlatform(TorchGpuPlatform):
    name = "cuda"
    graph_name = "cuda-graphs"
    collectives_name = "nccl"
    communicator_cls: ClassVar[type[NcclCommunicator]] = NcclCommunicator
    graph_runner_cls: ClassVar[type[CudaGraphRunner]] = CudaGraphRunner
    no_device = "no NVIDIA GPU visible (check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES)"

    @classmethod
    def build_error(cls) -> str | None:
        return cuda_build_error(torch.version.cuda, torch.version.hip)

    @classmethod
    def visible_devices(cls) -> int:
        return visible_cuda_devices()
