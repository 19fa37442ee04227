"""RCCL collectives through torch.distributed (a ROCm build of torch answers "nccl" with RCCL)."""

from __future__ import annotations

from portside.contract import TorchDistributedCommunicator

__all__ = ["RcclCommunicator"]


class RcclCommunicator(TorchDistributedCommunicator):
    """Collectives over a torch.distributed group; the rocm platform initialises it with "nccl",
    which is RCCL on ROCm builds. Any initialised group works (the tests use gloo on CPU)."""

    name = "rccl"
