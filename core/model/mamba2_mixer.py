"""The Mamba-2 mixer (state space duality, SSD) every Mamba-2 family model shares: Mamba2,
Bamba, Granite 4.0-H, Nemotron-H (and Falcon-H1 with its multipliers and norm options).

    in_proj(x) -> z (gate) | xBC | dt
    xBC -> causal depthwise conv1d (+ silu)       state: the last K - 1 inputs   [conv_dim, K - 1]
        -> x [H, P], B [G, N], C [G, N]
    y = SSD scan(x, dt, A = -exp(A_log), B, C) + D x  state: [H, P, N] fp32
    y -> gated RMSNorm with z (per group of channels) -> out_proj

Sizes are constructor arguments (each architecture reads its own config fields), so any model
with this mixer builds it. The kernels are the platform's (`ModelOps.causal_conv1d`,
`ModelOps.ssd_scan`; core's references by default), over the step's `RecurrentMetadata`.

Tensor parallelism (as vLLM's MambaMixer2 shards it): heads are split over ranks, so the z, x
and dt columns of in_proj, the x channels of the convolution, A_log / D / dt_bias, the gated
norm's weight and out_proj's input (row-parallel) are each rank's heads. The B / C groups are
split with them where the ranks divide the groups; with fewer groups than ranks (a divisor of
the ranks) each rank keeps a copy of the one group its heads read. The gated norm normalises
each group of channels; a group that spans ranks (fewer norm groups than ranks) sums its squares
over them (an all-gather of one value per token and rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import RecurrentMetadata, kernels_for
from portside.model.decoder import TP
from portside.model.layers import LinearBase, RowParallelLinear, _copy, _param

__all__ = ["Mamba2Mixer", "Mamba2Sharding"]


class Mamba2Sharding:
    """Which heads and groups rank `rank` of `size` keeps, and where its rows sit in the
    checkpoint's fused tensors (in_proj rows, conv channels)."""

    def __init__(self, num_heads: int, head_dim: int, n_groups: int, state_size: int, rank: int, size: int) -> None:
        if num_heads % size:
            raise ValueError(f"Mamba-2: {num_heads} heads do not split over {size} tensor-parallel ranks")
        if n_groups % size and size % n_groups:
            raise ValueError(f"Mamba-2: {n_groups} B/C groups and {size} tensor-parallel ranks: one must divide the "
                             "other (groups split over ranks, or each group copied to the ranks of its heads)")
        self.rank, self.size = rank, size
        self.heads = num_heads // size  # this rank's
        self.head_dim, self.state_size = head_dim, state_size
        self.inner = self.heads * head_dim  # this rank's share of the intermediate size
        self.total_inner, self.total_groups, self.total_heads = num_heads * head_dim, n_groups, num_heads
        self.groups = n_groups // size if n_groups >= size else 1
        self.first_group = rank * self.groups if n_groups >= size else rank * n_groups // size
        self.conv_dim = self.inner + 2 * self.groups * state_size  # this rank's conv channels

    def xbc_segments(self, offset: int) -> list[tuple[int, int]]:
        """(first row in the checkpoint, rows) of this rank's x, B and C, in that order; `offset`
        is where the checkpoint's xBC block starts (in_proj: after z; conv1d: 0)."""
        I, GN, N = self.total_inner, self.total_groups * self.state_size, self.state_size
        g0 = self.first_group * N
        return [(offset + self.rank * self.inner, self.inner), (offset + I + g0, self.groups * N),
                (offset + I + GN + g0, self.groups * N)]

    def in_proj_segments(self) -> list[tuple[int, int]]:
        """This rank's in_proj rows: z, then x, B, C, then dt (checkpoint order: z | xBC | dt)."""
        I, GN = self.total_inner, self.total_groups * self.state_size
        z = [(self.rank * self.inner, self.inner)]
        dt = [(2 * I + 2 * GN + self.rank * self.heads, self.heads)]
        return z + self.xbc_segments(I) + dt

    @property
    def in_proj_rows(self) -> int:
        return 2 * self.total_inner + 2 * self.total_groups * self.state_size + self.total_heads


def _load_segments(dst: torch.Tensor, loaded: torch.Tensor, segments: list[tuple[int, int]], rows: int, what: str) -> None:
    """Copy the checkpoint's rows `segments` (first, count), concatenated, into `dst`."""
    if loaded.shape[0] != rows:
        raise ValueError(f"{what}: has {loaded.shape[0]} rows, expected {rows}")
    at = 0
    for first, n in segments:
        _copy(dst.narrow(0, at, n), loaded.narrow(0, first, n), what)
        at += n


class _SegmentedColumnLinear(LinearBase):
    """A column-parallel linear whose rank's rows are several segments of the checkpoint
    tensor (in_proj: this rank's z, x, B, C and dt rows)."""

    def __init__(self, in_features: int, segments: list[tuple[int, int]], total_rows: int, bias: bool,
                 dtype: torch.dtype) -> None:
        self.segments, self.total_rows = segments, total_rows
        super().__init__(in_features, sum(n for _, n in segments), bias, dtype, bias_sharded=True)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _load_segments(param.data, loaded, self.segments, self.total_rows, "in_proj")


class _Conv(nn.Module):
    """The depthwise convolution's parameters (checkpoint names conv1d.weight [C, 1, K], conv1d.bias)."""

    weight: nn.Parameter  # [this rank's channels, K]
    bias: nn.Parameter | None


class _Norm(nn.Module):
    """The gated norm's weight (checkpoint name norm.weight)."""

    weight: nn.Parameter  # [this rank's channels]


def _row_param(shape: tuple[int, ...], dtype: torch.dtype, segments: list[tuple[int, int]], rows: int, what: str,
               squeeze: bool = False) -> nn.Parameter:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if squeeze and loaded.dim() == 3:  # conv1d.weight [C, 1, K]
            loaded = loaded.squeeze(1)
        _load_segments(param.data, loaded.to(param.dtype), segments, rows, what)

    return _param(*shape, dtype=dtype, loader=load)


class Mamba2Mixer(nn.Module):
    """x [T, hidden] -> [T, hidden], reading and updating this layer's states (conv, ssm).

    `norm_groups`: the gated norm's groups (HF: n_groups); `use_norm` False: y * silu(z) only;
    `norm_before_gate`: normalise, then gate (else gate, then normalise: Mamba2's order);
    `proj_multipliers`: five factors for in_proj's z, x, B, C and dt outputs (Falcon-H1's muP
    vector), None: none."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        tp: TP,
        dtype: torch.dtype,
        *,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        norm_eps: float = 1e-5,
        time_step_limit: Sequence[float] | None = None,
        activation: str = "silu",
        use_norm: bool = True,
        norm_groups: int | None = None,
        norm_before_gate: bool = False,
        proj_multipliers: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"Mamba-2 mixer: activation {activation!r} is not supported (the convolution applies silu)")
        self.ops, self.comm = tp.ops, tp.comm
        tp_rank, tp_size = tp.rank, tp.size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        sh = self.sharding = Mamba2Sharding(num_heads, head_dim, n_groups, state_size, tp_rank, tp_size)
        self.kernel = conv_kernel
        limit = tuple(float(v) for v in time_step_limit) if time_step_limit is not None else (0.0, math.inf)
        self.dt_limit: tuple[float, float] = (limit[0], limit[1])
        self.in_proj = _SegmentedColumnLinear(hidden_size, sh.in_proj_segments(), sh.in_proj_rows, use_bias, dtype)
        conv = sh.xbc_segments(0)
        conv_rows = sh.total_inner + 2 * sh.total_groups * state_size
        self.conv1d = _Conv()
        self.conv1d.weight = _row_param((sh.conv_dim, conv_kernel), dtype, conv, conv_rows, "conv1d.weight", squeeze=True)
        self.conv1d.bias = _row_param((sh.conv_dim,), dtype, conv, conv_rows, "conv1d.bias") if use_conv_bias else None
        heads = [(tp_rank * sh.heads, sh.heads)]
        # A_log, D and dt_bias in fp32 whatever the model's dtype (the scan's math is fp32)
        self.A_log = _row_param((sh.heads,), torch.float32, heads, num_heads, "A_log")
        self.D = _row_param((sh.heads,), torch.float32, heads, num_heads, "D")
        self.dt_bias = _row_param((sh.heads,), torch.float32, heads, num_heads, "dt_bias")
        self.use_norm, self.norm_before_gate, self.eps = use_norm, norm_before_gate, norm_eps
        if use_norm:
            self._setup_norm(norm_groups or n_groups, dtype)
        self.out_proj = RowParallelLinear(sh.total_inner, hidden_size, use_bias, tp_rank, tp_size, dtype, self.comm)
        self.multipliers: torch.Tensor | None  # registered buffer: in_proj's output scaled per column, or None
        vector = self._multiplier_vector(proj_multipliers) if proj_multipliers is not None else None
        self.register_buffer("multipliers", vector, persistent=False)

    def _setup_norm(self, norm_groups: int, dtype: torch.dtype) -> None:
        sh = self.sharding
        if sh.total_inner % norm_groups:
            raise ValueError(f"Mamba-2 gated norm: {norm_groups} groups do not split {sh.total_inner} channels")
        if norm_groups % self.tp_size and self.tp_size % norm_groups:
            raise ValueError(f"Mamba-2 gated norm: {norm_groups} groups and {self.tp_size} tensor-parallel ranks: "
                             "one must divide the other")
        self.norm_group_size = sh.total_inner // norm_groups
        # a group spanning ranks: this rank holds 1 / span of it
        self.norm_span = self.tp_size // norm_groups if norm_groups < self.tp_size else 1
        self.norm_local_groups = max(1, norm_groups // self.tp_size)
        self.norm = _Norm()
        self.norm.weight = _row_param((sh.inner,), dtype, [(self.tp_rank * sh.inner, sh.inner)], sh.total_inner,
                                      "norm.weight")

    def _multiplier_vector(self, m: Sequence[float]) -> torch.Tensor:
        if len(m) != 5:
            raise ValueError(f"Mamba-2 mixer: {len(m)} in_proj multipliers; expected 5 (z, x, B, C, dt)")
        sh = self.sharding
        GN = sh.groups * sh.state_size
        sizes = [sh.inner, sh.inner, GN, GN, sh.heads]
        return torch.cat([torch.full((n,), float(v)) for n, v in zip(sizes, m, strict=True)])

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's (conv state, ssm state) shapes on this rank."""
        sh = self.sharding
        return (sh.conv_dim, self.kernel - 1), (sh.heads, sh.head_dim, sh.state_size)

    def forward(self, x: torch.Tensor, state: Sequence[torch.Tensor], md: RecurrentMetadata) -> torch.Tensor:
        """x [T, hidden]; state: (conv [slots, conv_dim, K - 1], ssm [slots, H, P, N]) of this layer."""
        sh, T = self.sharding, x.shape[0]
        proj = self.in_proj(x)
        if self.multipliers is not None:
            proj = proj * self.multipliers.to(proj.dtype)
        z, xbc, dt = proj.split([sh.inner, sh.conv_dim, sh.heads], dim=-1)
        ops = kernels_for(self.ops, md)
        xbc = ops.causal_conv1d(xbc.contiguous(), self.conv1d.weight, self.conv1d.bias, state[0], md, "silu")
        GN = sh.groups * sh.state_size
        xs, B, C = xbc.split([sh.inner, GN, GN], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = ops.ssd_scan(
            xs.reshape(T, sh.heads, sh.head_dim), dt.contiguous(), A, B.reshape(T, sh.groups, sh.state_size),
            C.reshape(T, sh.groups, sh.state_size), state[1], md, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
            dt_limit=self.dt_limit,
        )
        return self.out_proj(self._gate(y.reshape(T, sh.inner), z).to(x.dtype))

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm (fp32): y * silu(z) normalised per group (or normalised, then gated)."""
        y, gate = y.float(), F.silu(z.float())
        if not self.use_norm:
            return y * gate
        if not self.norm_before_gate:
            y = y * gate
        T = y.shape[0]
        groups = y.view(T, self.norm_local_groups, -1)
        sq = groups.pow(2).sum(-1)  # [T, local groups]
        if self.norm_span > 1:  # this rank's channels are 1 / span of one group: add the other ranks' squares
            every = self.comm.all_gather(sq.contiguous(), dim=-1)  # [T, tp]
            first = self.tp_rank // self.norm_span * self.norm_span
            sq = every[:, first : first + self.norm_span].sum(-1, keepdim=True)
        y = (groups * torch.rsqrt(sq / self.norm_group_size + self.eps).unsqueeze(-1)).view(T, -1)
        y = y * self.norm.weight.float()
        return y * gate if self.norm_before_gate else y
