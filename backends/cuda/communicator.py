"""NCCL collectives through torch.distributed."""

from __future__ import annotations

from portside.contract import TorchDistributedCommunicator

__all__ = ["NcclCommunicator"]


class NcclCommunicator(TorchDistributedCommunicator):
    """Collectives over a torch.distributed group; the cuda platform initialises it with "nccl".

    Any initialised group works (the tests use gloo on CPU); the group's own backend decides the
    transport.
    """

    name = "nccl"
