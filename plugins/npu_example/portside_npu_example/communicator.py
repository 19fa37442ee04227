"""Collectives for the example NPU.

VENDOR: if torch.distributed speaks your collective library (HCCL, CNCL, oneCCL, ...), subclass
`TorchDistributedCommunicator` and choose the backend name through `Platform.dist_backend`: that
is all this file needs. If it does not, implement the four `Communicator` methods with your
library's calls instead. This example is simulated on the CPU, so its process group is gloo.
"""

from __future__ import annotations

import torch

from portside.backend_api import TorchDistributedCommunicator


class NpuExampleCommunicator(TorchDistributedCommunicator):
    name = "npu-example-gloo"

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # VENDOR: a place for a device-specific choice. Many collective libraries only gather
        # along dim 0 of contiguous buffers; gather that way and move the axis afterwards.
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x.movedim(dim, 0).contiguous()) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.movedim(dim, 0).contiguous(), group=self.group)
        return torch.cat(parts, dim=0).movedim(0, dim)
