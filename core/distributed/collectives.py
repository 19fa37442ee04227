"""Collectives as opaque torch operators, for model code that `torch.compile` traces.

Traced as it is, `dist.all_reduce(x, group=g)` makes the ProcessGroup object an input of the
compiled graph, and the compiled code then holds it for as long as the process lives: measured
with torch 2.13 over gloo, the group outlives `destroy_process_group` (also after
`torch._dynamo.reset()`), so its threads run into interpreter exit, where they can abort the
process. These operators take the group's *name* and resolve it when they run, so nothing
compiled holds the group (vLLM does the same). Eager code calls torch.distributed directly
(`TorchDistributedCommunicator` picks), since a custom operator's Python wrapper costs microseconds
a call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)  # type: ignore[arg-type]  # a NewType of str in torch 2.13


@torch.library.custom_op("portside::all_reduce", mutates_args=("x",))
def all_reduce(x: torch.Tensor, group_name: str) -> None:
    """Sum `x` over the ranks of the group named `group_name`, in place."""
    dist.all_reduce(x, group=_group(group_name))


def gather(x: torch.Tensor, dim: int, world_size: int, group: Any) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (`group` None: the default one)."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.library.custom_op("portside::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """`gather` over the group named `group_name`."""
    return gather(x, dim, world_size, _group(group_name))


@all_gather.register_fake
def _(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


@torch.library.custom_op("portside::broadcast", mutates_args=("x",))
def broadcast(x: torch.Tensor, src: int, group_name: str) -> None:
    """Rank `src`'s `x` on every rank, in place (`src` as `dist.broadcast` takes it)."""
    dist.broadcast(x, src=src, group=_group(group_name))
