"""RocmPlatform: AMD GPUs through a ROCm build of torch (which exposes HIP as the "cuda" device)."""

from __future__ import annotations

from typing import ClassVar

import torch

from portside.backends.rocm.communicator import RcclCommunicator
from portside.backends.rocm.graph import HipGraphRunner
from portside.backends.triton.gpu_platform import TorchGpuPlatform, gpu_availability, has_triton
from portside.contract import Availability

__all__ = ["RocmPlatform", "rocm_build_error"]


def rocm_build_error(hip_version: str | None) -> str | None:
    """Why this torch build cannot drive AMD GPUs, or None."""
    if hip_version is None:
        return (
            "this torch build has no ROCm support (torch.version.hip is None; "
            "ROCm wheels come from download.pytorch.org, not PyPI)"
        )
    return None


class RocmPlatform(TorchGpuPlatform):
    name = "rocm"
    priority = 100
    graph_name = "hip-graphs"
    collectives_name = "rccl"
    communicator_cls: ClassVar[type[RcclCommunicator]] = RcclCommunicator
    graph_runner_cls: ClassVar[type[HipGraphRunner]] = HipGraphRunner

    @classmethod
    def is_available(cls) -> Availability:
        build_error = rocm_build_error(torch.version.hip)
        # No NVML here: the HIP runtime's device count (hipGetDeviceCount) is the probe.
        count = 0 if build_error else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        return gpu_availability(
            build_error,
            has_triton=build_error is not None or has_triton(),
            device_count=count,
            no_device="no AMD GPU visible (check the amdgpu driver with rocm-smi, /dev/kfd access and HIP_VISIBLE_DEVICES)",
        )
