"""RocmPlatform: AMD GPUs through a ROCm build of torch (which exposes HIP as the "cuda" device)."""

from __future__ import annotations

from typing import ClassVar

import torch

from portside.backends.rocm.communicator import RcclCommunicator
from portside.backends.rocm.graph import HipGraphRunner
from portside.backends.triton.gpu_platform import TorchGpuPlatform

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
    """AMD GPUs; devices are counted by the HIP runtime (hipGetDeviceCount, the inherited
    `visible_devices`): there is no NVML here."""

    name = "rocm"
    graph_name = "hip-graphs"
    collectives_name = "rccl"
    communicator_cls: ClassVar[type[RcclCommunicator]] = RcclCommunicator
    graph_runner_cls: ClassVar[type[HipGraphRunner]] = HipGraphRunner
    no_device = "no AMD GPU visible (check the amdgpu driver with rocm-smi, /dev/kfd access and HIP_VISIBLE_DEVICES)"

    @classmethod
    def build_error(cls) -> str | None:
        return rocm_build_error(torch.version.hip)
