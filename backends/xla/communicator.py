"""Collectives through torch-xla (`torch_xla.core.xla_model`), traced into the step's graph.

On a TPU slice each process drives one chip and the collectives run over the ICI links; the
group is a list of replica groups in XLA's sense (None: every device of the runtime).
"""

from __future__ import annotations

from typing import Any

import torch

from portside.contract import Communicator

__all__ = ["XlaCommunicator"]


class XlaCommunicator(Communicator):
    name = "xla"

    def __init__(self, group: Any = None) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        self.groups = group  # XLA replica groups, e.g. [[0, 1, 2, 3]]; None: all devices
        if group is None:
            world, rank = xr.world_size(), xr.global_ordinal()
        else:
            ordinal = xr.global_ordinal()
            mine = next(g for g in group if ordinal in g)
            world, rank = len(mine), list(mine).index(ordinal)
        super().__init__(rank, world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._xm.all_reduce(self._xm.REDUCE_SUM, x, groups=self.groups)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._xm.all_gather(x, dim=dim % x.dim(), groups=self.groups)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        # Sum of the tensor on `src` and zeros elsewhere: the broadcast XLA lowers to one collective.
        contribution = x if self.rank == src else torch.zeros_like(x)
        return self.all_reduce(contribution)

    def barrier(self) -> None:
        self._xm.rendezvous("portside.barrier")
