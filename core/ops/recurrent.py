"""Pure-torch references of the recurrent-layer kernels (`portside.contract.RecurrentKernels`):
causal depthwise conv1d, the Mamba-2 and Mamba-1 selective scans and the gated delta rule.
Conventions (batch layout, state slots, dtypes) in `portside.contract.recurrent`.

These are the oracle every backend is tested against and the default every platform inherits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from portside.contract.recurrent import RecurrentMetadata

__all__ = ["causal_conv1d", "gated_delta_rule", "selective_scan", "ssd_scan"]


def _requests(md: RecurrentMetadata):
    """(i, first token, end token, slot, has initial state) per request."""
    qsl = md.query_start_loc_cpu
    for i in range(len(qsl) - 1):
        yield i, qsl[i], qsl[i + 1], md.state_slots_cpu[i], md.has_initial_state_cpu[i]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  md: RecurrentMetadata, activation: str | None = "silu") -> torch.Tensor:
    """x [T, C], weight [C, K], bias [C] or None, conv_state [slots, C, K - 1] -> [T, C].

    out[t, c] = bias[c] + sum_j weight[c, j] * u[c, t + j], where u is the request's K - 1 earlier
    inputs (its slot's state, or zeros) followed by its tokens; the slot is left holding the last
    K - 1 columns of u."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation {activation!r}; expected 'silu' or None")
    K = weight.shape[1]
    out = torch.empty_like(x)
    w = weight.float()
    for _, a, b, slot, init in _requests(md):
        prev = conv_state[slot].float() if init else x.new_zeros(x.shape[1], K - 1, dtype=torch.float32)
        u = torch.cat([prev, x[a:b].float().t()], dim=1)  # [C, K - 1 + L]
        y = F.conv1d(u.unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(), groups=x.shape[1])[0]
        if activation == "silu":
            y = F.silu(y)
        out[a:b] = y.t().to(x.dtype)
        if K > 1:
            conv_state[slot] = u[:, u.shape[1] - (K - 1):].to(conv_state.dtype)
    return out


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float] = (0.0, math.inf)):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if limit != (0.0, math.inf):
        dt = dt.clamp(limit[0], limit[1])
    return dt


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
             dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
             dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """Mamba-2: x [T, H, P], dt [T, H], A [H], B, C [T, G, N], ssm_state [slots, H, P, N] -> y [T, H, P].

    Per token: dt' = clamp(softplus(dt + dt_bias)); h = exp(dt' A) h + dt' x (outer) B;
    y = h . C + D x (head h reads group h // (H // G))."""
    H, G = x.shape[1], B.shape[1]
    rep = H // G
    y = torch.empty_like(x)
    dts = _dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    A32 = A.float()
    Bh, Ch = B.float().repeat_interleave(rep, dim=1), C.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    for _, a, b, slot, init in _requests(md):
        h = ssm_state[slot].float() if init else x.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        for t in range(a, b):
            dA = torch.exp(dts[t] * A32)  # [H]
            h = h * dA[:, None, None] + (dts[t][:, None] * x[t].float())[:, :, None] * Bh[t][:, None, :]
            out = (h * Ch[t][:, None, :]).sum(-1)
            if D is not None:
                out = out + D.float()[:, None] * x[t].float()
            y[t] = out.to(x.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return y


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = True) -> torch.Tensor:
    """Mamba-1: x, dt [T, Dm], A [Dm, N], B, C [T, N], ssm_state [slots, Dm, N] -> y [T, Dm].

    Per token: dt' = softplus(dt + dt_bias); h = exp(dt' A) h + (dt' x) (outer) B; y = h . C + D x,
    times silu(z) when z is given."""
    y = torch.empty_like(x)
    dts = _dt(dt, dt_bias, dt_softplus)
    A32 = A.float()
    for _, a, b, slot, init in _requests(md):
        h = ssm_state[slot].float() if init else x.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        for t in range(a, b):
            h = torch.exp(dts[t][:, None] * A32) * h + (dts[t] * x[t].float())[:, None] * B[t].float()[None, :]
            out = (h * C[t].float()[None, :]).sum(-1)
            if D is not None:
                out = out + D.float() * x[t].float()
            if z is not None:
                out = out * F.silu(z[t].float())
            y[t] = out.to(x.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fp32), as Gated DeltaNet normalises q and k."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, md: RecurrentMetadata, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Gated DeltaNet: q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv], state [slots, Hv, K, V] -> o [T, Hv, V].

    Per token and value head (reading key head j // (Hv // Hk)), with q, k l2-normalised
    (`use_qk_l2norm`) and q scaled: S = exp(g) S; S = S + k (outer) beta (v - k S); o = q S."""
    Hv = v.shape[1]
    rep = Hv // q.shape[1]
    qf, kf = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q.float(), k.float())
    qf = (qf * scale).repeat_interleave(rep, dim=1)
    kf = kf.repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for _, a, b, slot, init in _requests(md):
        S = state[slot].float() if init else v.new_zeros(state.shape[1:], dtype=torch.float32)  # [Hv, K, V]
        for t in range(a, b):
            S = S * torch.exp(gf[t])[:, None, None]
            kv_mem = (S * kf[t][:, :, None]).sum(1)  # [Hv, V]
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            S = S + kf[t][:, :, None] * delta[:, None, :]
            o[t] = (S * qf[t][:, :, None]).sum(1).to(v.dtype)
        state[slot] = S.to(state.dtype)
    return o
