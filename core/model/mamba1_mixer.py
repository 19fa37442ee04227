"""The Mamba-1 mixer (Jamba's state-space layer), tensor-parallel ready, and the parameter helper
the state-space models share (`split_param`).

Per token: in_proj -> (x, z); x through a depthwise causal conv1d and silu; x_proj(x) ->
(dt low-rank, B, C), each RMS-normed where the model has those norms (Jamba); dt_proj lifts dt to
every channel (its bias added inside the scan, before softplus); the selective scan with the
output gate silu(z); out_proj. The conv's and the scan's per-sequence states live in the runner's
state slots (`ForwardContext.state_caches`); the kernels are the platform's
(`ModelOps.causal_conv1d`, `ModelOps.selective_scan`).

Tensor parallelism (as vLLM's MambaMixer): the intermediate channels are split over ranks
(in_proj, conv, A, D, dt_proj column-split; x_proj and out_proj row-split, so dt, B and C are
summed over ranks and every rank sees them whole).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from portside.contract import RecurrentMetadata, kernels_for
from portside.model.decoder import TP
from portside.model.layers import ColumnParallelLinear, LinearBase, RMSNorm, RowParallelLinear, _copy, _divide, _param

__all__ = ["Conv1dParams", "Mamba1Mixer", "StackedColumnParallelLinear", "split_param"]


def _copy_rank_rows(dst: torch.Tensor, loaded: torch.Tensor, parts: Sequence[int], tp_rank: int, what: str) -> None:
    """Copy rank `tp_rank`'s slice of each of `parts` (row counts stacked in `loaded`) into `dst`, in order."""
    if loaded.shape[0] != sum(parts):
        raise ValueError(f"{what}: checkpoint tensor has {loaded.shape[0]} rows, expected {sum(parts)} "
                         f"({' + '.join(map(str, parts))})")
    at = start = 0
    for full in parts:
        n = full * dst.shape[0] // sum(parts)  # this rank's share of the part
        _copy(dst.narrow(0, at, n), loaded.narrow(0, start + tp_rank * n, n), what)
        at, start = at + n, start + full


def split_param(parts: Sequence[int], trailing: tuple[int, ...], tp_rank: int, tp_size: int, dtype: torch.dtype,
                what: str) -> nn.Parameter:
    """A parameter whose checkpoint tensor stacks `parts` along dim 0 (one part: a plain
    per-channel tensor such as A_log or D), each part split evenly over the ranks: this rank keeps
    its slice of every part, in order, ``[sum(parts) / tp, *trailing]``. The checkpoint tensor may
    carry extra unit dimensions (a conv1d weight [C, 1, K])."""
    local = sum(_divide(p, tp_size, what) for p in parts)

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.numel() != sum(parts) * math.prod(trailing):
            raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {sum(parts)} rows "
                             f"of {tuple(trailing)}")
        _copy_rank_rows(param.data, loaded.reshape(sum(parts), *trailing), parts, tp_rank, what)

    return _param(local, *trailing, dtype=dtype, loader=loader)


class StackedColumnParallelLinear(LinearBase):
    """A column-parallel projection whose one checkpoint tensor stacks several outputs along its
    rows (Mamba's in_proj: x, then z), each split over the ranks: this rank's rows are its slice
    of each, in order. Loaded whole (one checkpoint tensor, one part)."""

    column_split = True

    def __init__(self, in_features: int, parts: Sequence[int], bias: bool, tp_rank: int, tp_size: int,
                 dtype: torch.dtype) -> None:
        self.stacked, self.tp_rank, self.tp_size = list(parts), tp_rank, tp_size
        super().__init__(in_features, sum(_divide(p, tp_size, "output features") for p in parts), bias, dtype,
                         bias_sharded=True)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return sum(self.stacked)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy_rank_rows(param.data, loaded, self.stacked, self.tp_rank, "in_proj")


class Conv1dParams(nn.Module):
    """A depthwise conv's parameters under Hugging Face's names: weight [C / tp, K] (checkpoint
    [C, 1, K]), bias [C / tp] or None."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight: nn.Parameter = weight
        self.bias: nn.Parameter | None = bias


class Mamba1Mixer(nn.Module):
    """x [T, hidden] -> [T, hidden], reading and updating a request's conv and SSM state.

    Checkpoint names (Hugging Face's Jamba / Mamba): in_proj (x then z rows, fused), conv1d.weight
    [I, 1, K] and .bias, x_proj, dt_proj (weight and bias), A_log [I, N], D [I], out_proj,
    dt_layernorm, b_layernorm, c_layernorm (with `inner_norms`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int, dt_rank: int,
                 conv_bias: bool, proj_bias: bool, inner_norms: bool, norm_eps: float, tp: TP,
                 dtype: torch.dtype) -> None:
        super().__init__()
        I, N, K = intermediate_size, state_size, conv_kernel  # noqa: E741 - the papers' names
        if I % tp.size:
            raise ValueError(f"the Mamba intermediate size ({I}) is not divisible by the tensor-parallel size "
                             f"({tp.size}); choose a tensor-parallel size that divides it")
        self.ops, self.I, self.N, self.K, self.dt_rank = tp.ops, I, N, K, dt_rank
        self.local = I // tp.size
        self.in_proj = StackedColumnParallelLinear(hidden_size, [I, I], proj_bias, tp.rank, tp.size, dtype)
        self.conv1d = Conv1dParams(split_param([I], (K,), tp.rank, tp.size, dtype, "conv1d.weight"),
                                   split_param([I], (), tp.rank, tp.size, dtype, "conv1d.bias") if conv_bias else None)
        self.x_proj = RowParallelLinear(I, dt_rank + 2 * N, False, tp.rank, tp.size, dtype, tp.comm)
        self.dt_proj = ColumnParallelLinear(dt_rank, I, True, tp.rank, tp.size, dtype)
        self.A_log = split_param([I], (N,), tp.rank, tp.size, dtype, "A_log")
        self.D = split_param([I], (), tp.rank, tp.size, dtype, "D")
        self.out_proj = RowParallelLinear(I, hidden_size, proj_bias, tp.rank, tp.size, dtype, tp.comm)
        self.inner_norms = inner_norms
        if inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps, dtype)
            self.b_layernorm = RMSNorm(N, norm_eps, dtype)
            self.c_layernorm = RMSNorm(N, norm_eps, dtype)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's per-sequence state: the conv's last K - 1 inputs, the SSM state."""
        return (self.local, self.K - 1), (self.local, self.N)

    def forward(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], md: RecurrentMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        x, z = self.in_proj(h).split([self.local, self.local], dim=-1)  # [T, I / tp] each
        ops = kernels_for(self.ops, md)
        x = ops.causal_conv1d(x, self.conv1d.weight, self.conv1d.bias, conv_state, md, "silu")
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.N, self.N], dim=-1)  # whole on every rank
        if self.inner_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = self.dt_proj.matmul(dt)  # [T, I / tp]; its bias goes in the scan, before softplus
        A = -torch.exp(self.A_log.float())
        y = ops.selective_scan(x, dt, A, B, C, ssm_state, md, D=self.D, z=z, dt_bias=self.dt_proj.bias,
                                    dt_softplus=True)
        return self.out_proj(y.to(h.dtype))

