"""Collectives: the `Communicator` tensor (and pipeline) parallelism talks through, the world-size-1
one, and `TorchDistributedCommunicator` for devices whose collectives torch.distributed speaks.

Traced by `torch.compile`, `TorchDistributedCommunicator`'s collectives are opaque `portside::`
operators (below). Traced as it is, ``dist.all_reduce(x, group=g)`` makes the ProcessGroup object
an input of the compiled graph, and the compiled code then holds it for as long as the process
lives: measured with torch 2.13 over gloo, the group outlives `destroy_process_group` (also after
`torch._dynamo.reset()`), so its threads run into interpreter exit, where they can abort the
process. The operators take the group's *name* and resolve it when they run, so nothing compiled
holds the group (vLLM does the same). Eager code calls torch.distributed directly, since a custom
operator's Python wrapper costs microseconds a call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.distributed as dist

if dist.is_available():  # a torch built without it runs world size 1 only (`Platform.communicator`)
    from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["Communicator", "SingleRankCommunicator", "TorchDistributedCommunicator"]


class Communicator(ABC):
    """Collectives over one tensor-parallel group. All methods are collective calls."""

    name: ClassVar[str] = "abstract"
    """The implementation's name, in logs."""
    rank: int
    """This process's rank in the group."""
    world_size: int
    """Ranks in the group."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the result (may be `x` reduced in place)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s tensor on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank of the group has called it."""

    def destroy(self) -> None:
        """Release the group. Default: nothing."""

    # Point-to-point, between pipeline-parallel stages (each rank sends its stage's output to the
    # same tensor-parallel rank of the next stage). Ranks here are global ranks of the world, not
    # of this group. The defaults use torch.distributed's default group (blocking send / recv),
    # so a communicator written before pipeline parallelism works unchanged; a platform whose
    # collectives are not torch.distributed's overrides both, or sets
    # `Platform.supports_pipeline_parallel = False`.

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to global rank `dst`, which calls `recv` with a tensor of its shape and dtype."""
        dist.send(x.contiguous(), dst=dst)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive global rank `src`'s `send` into `x` (shape and dtype agreed beforehand); returns `x`."""
        dist.recv(x, src=src)
        return x


class SingleRankCommunicator(Communicator):
    """World size 1: every collective is the identity."""

    name = "single"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x`."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """`x`."""
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x`."""
        return x

    def barrier(self) -> None:
        """Nothing to wait for."""
        return None


# ---- the opaque operators `torch.compile` traces (module docstring) ---------------------------


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)  # type: ignore[arg-type]  # a NewType of str in torch 2.13


def _gather(x: torch.Tensor, dim: int, world_size: int, group: Any) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (`group` None: the default one)."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.library.custom_op("portside::all_reduce", mutates_args=("x",))
def _all_reduce_op(x: torch.Tensor, group_name: str) -> None:
    """Sum `x` over the ranks of the group named `group_name`, in place."""
    dist.all_reduce(x, group=_group(group_name))


@torch.library.custom_op("portside::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """`_gather` over the group named `group_name`."""
    return _gather(x, dim, world_size, _group(group_name))


@_all_gather_op.register_fake
def _(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


@torch.library.custom_op("portside::broadcast", mutates_args=("x",))
def _broadcast_op(x: torch.Tensor, src: int, group_name: str) -> None:
    """Rank `src`'s `x` on every rank, in place (`src` as `dist.broadcast` takes it)."""
    dist.broadcast(x, src=src, group=_group(group_name))


class TorchDistributedCommunicator(Communicator):
    """Collectives through an initialised torch.distributed process group (gloo, nccl, ...).

    Backends whose collectives torch.distributed already speaks subclass this and only choose
    the process-group backend name (`Platform.dist_backend`). Traced by `torch.compile`, the
    collectives are the opaque `portside::` operators of this module, which find the group by
    name when they run: a compiled graph that held the group itself would keep it alive past
    `destroy_process_group`.
    """

    name = "torch.distributed"

    def __init__(self, group: Any = None) -> None:
        self._dist = dist
        """The `torch.distributed` module, for a subclass's own calls, such as
        ``self._dist.all_gather(parts, x, group=self.group)``: the example plugin in `plugins/`
        makes that call, so plugins copied from it rely on this name."""
        self.group = group
        """The process group (None: the default one)."""
        pg = dist.group.WORLD if group is None else group
        if pg is None:
            raise RuntimeError("TorchDistributedCommunicator needs an initialised torch.distributed process group")
        self.group_name = pg.group_name
        """The group's name, by which the traced operators find it."""
        super().__init__(dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world_size > 1:
            if torch.compiler.is_compiling():
                _all_reduce_op(x, self.group_name)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return _all_gather_op(x, dim, self.world_size, self.group_name)
        return _gather(x, dim, self.world_size, self.group)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src` is a rank of this group (torch.distributed takes a global one)."""
        if self.world_size > 1:
            if self.group is not None:
                src = dist.get_global_rank(self.group, src)
            if torch.compiler.is_compiling():
                _broadcast_op(x, src, self.group_name)
            else:
                dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
