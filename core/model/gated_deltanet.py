"""The Gated DeltaNet linear-attention layer of Qwen3-Next and Qwen3.5 (`GatedDeltaNet`),
tensor-parallel ready.

Per token: one projection gives q, k (key heads Hk of size dk), v (value heads Hv of size dv,
value head j reading key head j // (Hv // Hk)), the output gate z, and per value head b and a;
q, k and v go through a depthwise causal convolution (kernel K, silu) over their channels; the
gated delta rule (`ModelOps.gated_delta_rule`, q and k l2-normalised, q scaled by dk^-1/2)
runs with decay g = -exp(A_log) * softplus(a + dt_bias) and step size beta = sigmoid(b); its
output is RMS-normalised per value head, times silu(z), and projected back (`out_proj`).

State per sequence (`state_shapes`): the convolution's last K - 1 inputs [conv channels, K - 1]
in the model's dtype, and the delta rule's state [Hv, dk, dv] in fp32.

Checkpoint layouts: Qwen3-Next fuses q, k, v, z into ``in_proj_qkvz`` and b, a into
``in_proj_ba``, grouped by key head (each key head's q, k, then its value heads' v, then z);
Qwen3.5 keeps ``in_proj_qkv`` (q of every head, then k, then v), ``in_proj_z``, ``in_proj_b``
and ``in_proj_a``. Either way this rank's rows are kept as [q | k | v (| z)] of its own heads.

Tensor parallelism (as vLLM's Qwen3-Next layer): key heads and value heads split evenly across
ranks (each rank's value heads read only its key heads), so the convolution channels, the
state and the projections split with them; `out_proj` is row-parallel (one all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import RecurrentMetadata, kernels_for
from portside.model.decoder import TP
from portside.model.layers import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
    _copy,
    _param,
    default_weight_loader,
)

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "gdn_sizes"]


def gdn_sizes(hf: object, tp_size: int) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim, conv kernel) of a config, checked
    for this tensor-parallel size."""
    hk, hv = int(hf.linear_num_key_heads), int(hf.linear_num_value_heads)  # type: ignore[attr-defined]
    dk, dv = int(hf.linear_key_head_dim), int(hf.linear_value_head_dim)  # type: ignore[attr-defined]
    kernel = int(hf.linear_conv_kernel_dim)  # type: ignore[attr-defined]
    if hv % hk:
        raise ValueError(f"Gated DeltaNet: linear_num_value_heads ({hv}) is not a multiple of "
                         f"linear_num_key_heads ({hk})")
    if hk % tp_size or hv % tp_size:
        raise ValueError(f"Gated DeltaNet: {hk} key heads and {hv} value heads cannot be split evenly over "
                         f"{tp_size} tensor-parallel ranks; use a tensor-parallel size that divides both")
    if kernel < 1:
        raise ValueError(f"Gated DeltaNet: linear_conv_kernel_dim {kernel}; expected at least 1")
    return hk, hv, dk, dv, kernel


def parts_slice(t: torch.Tensor, sizes: list[int], rank: int, size: int) -> torch.Tensor:
    """Rows of `t` that are the parts `sizes` one after another: each part's rank-th 1/size, joined."""
    out, start = [], 0
    for s in sizes:
        n = s // size
        out.append(t.narrow(0, start + rank * n, n))
        start += s
    return torch.cat(out)


def groups_slice(t: torch.Tensor, groups: int, sizes: list[int], rank: int, size: int) -> torch.Tensor:
    """Rows of `t` that are `groups` groups of the parts `sizes`: this rank's groups, regrouped
    part by part (every group's part 0, then every group's part 1, ...)."""
    g = groups // size
    if t.shape[0] != groups * sum(sizes):
        raise ValueError(f"has {t.shape[0]} rows, expected {groups * sum(sizes)}")
    t = t.reshape(groups, sum(sizes), *t.shape[1:]).narrow(0, rank * g, g)
    return torch.cat([p.reshape(-1, *t.shape[2:]) for p in t.split(sizes, dim=1)])


class RearrangedColumnLinear(LinearBase):
    """A column-parallel projection whose checkpoint rows are not this rank's rows in one block:
    `select(full checkpoint tensor)` gives them (fused q/k/v of several heads, grouped layouts).
    Kept in full precision: quantized formats address rows by `out_partition` blocks."""

    quantizable = False
    column_split = True

    def __init__(self, in_features: int, out_local: int, select: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, out_local, False, dtype, bias_sharded=True)
        self.select = select

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, self.select(loaded), "weight")


class DepthwiseConv(nn.Module):
    """The convolution's weight [channels of this rank, 1, K] (the checkpoint's nn.Conv1d layout)."""

    def __init__(self, channels: int, kernel: int, select: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.select = select
        self.weight = _param(channels, 1, kernel, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, self.select(loaded), "conv1d.weight")


class GatedRMSNorm(nn.Module):
    """x / rms(x) * weight (in x's dtype), times silu(gate) in fp32; over the last axis (one
    value head)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, loader=default_weight_loader)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """x [T, hidden] -> [T, hidden]; `layout` "qkvz" (Qwen3-Next's checkpoint names) or "split"
    (Qwen3.5's)."""

    def __init__(self, hf: object, hidden: int, eps: float, tp: TP, dtype: torch.dtype, layout: str,
                 state_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hk, hv, dk, dv, kernel = gdn_sizes(hf, tp.size)
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Gated DeltaNet: the convolution's activation {act!r} is not supported; expected 'silu'")
        self.ops, self.layout, self.kernel = tp.ops, layout, kernel
        n, r = tp.size, tp.rank
        self.hk, self.hv, self.dk, self.dv = hk // n, hv // n, dk, dv  # heads of this rank
        self.key_dim, self.value_dim = self.hk * dk, self.hv * dv  # this rank's
        self.conv_dim = 2 * self.key_dim + self.value_dim
        qkv_sizes = [hk * dk, hk * dk, hv * dv]  # the whole layer's
        if layout == "qkvz":
            per = hv // hk  # value heads per key head
            self.in_proj_qkvz = RearrangedColumnLinear(
                hidden, self.conv_dim + self.value_dim,
                lambda t: groups_slice(t, hk, [dk, dk, per * dv, per * dv], r, n), dtype)
            self.in_proj_ba = RearrangedColumnLinear(
                hidden, 2 * self.hv, lambda t: groups_slice(t, hk, [per, per], r, n), dtype)
        elif layout == "split":
            self.in_proj_qkv = RearrangedColumnLinear(
                hidden, self.conv_dim, lambda t: parts_slice(t, qkv_sizes, r, n), dtype)
            self.in_proj_z = ColumnParallelLinear(hidden, hv * dv, False, r, n, dtype)
            self.in_proj_b = ColumnParallelLinear(hidden, hv, False, r, n, dtype)
            self.in_proj_a = ColumnParallelLinear(hidden, hv, False, r, n, dtype)
        else:
            raise ValueError(f"Gated DeltaNet checkpoint layout {layout!r}; expected 'qkvz' or 'split'")
        self.conv1d = DepthwiseConv(self.conv_dim, kernel, lambda t: parts_slice(t, qkv_sizes, r, n), dtype)
        heads = lambda t: t.narrow(0, r * self.hv, self.hv)  # noqa: E731 - this rank's value heads
        self.dt_bias = _param(self.hv, dtype=dtype, loader=lambda p, t, s=None: _copy(p.data, heads(t), "dt_bias"))
        self.A_log = _param(self.hv, dtype=dtype, loader=lambda p, t, s=None: _copy(p.data, heads(t), "A_log"))
        self.norm = GatedRMSNorm(dv, eps, dtype)
        self.out_proj = RowParallelLinear(hv * dv, hidden, False, r, n, dtype, tp.comm)
        self.conv_state_dtype, self.state_dtype = dtype, state_dtype

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
        """(shapes, dtypes) of one sequence's state in this layer: the convolution's, the delta rule's."""
        return ((self.conv_dim, self.kernel - 1), (self.hv, self.dk, self.dv)), (self.conv_state_dtype, self.state_dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> (q|k|v [T, conv channels], z [T, value dim], b, a [T, value heads])."""
        if self.layout == "qkvz":
            qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)
            return qkv.contiguous(), z, b, a
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], md: RecurrentMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv, z, b, a = self.project(x)
        conv_state, ssm_state = state
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        ops = kernels_for(self.ops, md)
        qkv = ops.causal_conv1d(qkv, weight, None, conv_state, md, "silu")
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(T, self.hk, self.dk), k.reshape(T, self.hk, self.dk), v.reshape(T, self.hv, self.dv)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv] log decay
        beta = torch.sigmoid(b.float())
        o = ops.gated_delta_rule(q, k, v, g, beta, ssm_state, md, self.dk ** -0.5, use_qk_l2norm=True)
        o = self.norm(o, z.reshape(T, self.hv, self.dv))  # [T, Hv, dv]
        return self.out_proj(o.reshape(T, self.value_dim))
