"""Pure-torch references of the recurrent-layer kernels (`portside.contract.RecurrentKernels`):
causal depthwise conv1d, the Mamba-2 and Mamba-1 selective scans and the gated delta rule.
Conventions (batch layout, state slots, dtypes) in `portside.contract.recurrent`.

These are the oracle every backend is tested against and the default every platform inherits,
so they are written to be usable on real prompts: the one-token requests of a step (decodes,
first in the batch) advance together, one recurrence step batched over their slots (in groups of
at most `DECODE_GROUP_BYTES` of state); each other request (a prefill chunk) runs in a chunked
form with no per-token Python loop:

- `ssd_scan` (Mamba-2) and `gated_delta_rule`: chunks of `CHUNK` tokens; inside a chunk the
  outputs are a masked (decayed) quadratic form, and the state is passed from chunk to chunk
  (the SSD form of Mamba-2, and the WY/UT form of chunked Gated DeltaNet, whose intra-chunk
  triangular system is inverted with matmuls only, so it runs on any torch device);
- `selective_scan` (Mamba-1, one decay per channel and state entry): an inclusive
  Hillis-Steele scan of h_t = a_t h_{t-1} + b_t inside each chunk of `SELECTIVE_CHUNK` tokens
  (products of decays only: no division by a decay, nothing to overflow), the state carried
  between chunks;
- `causal_conv1d`: one `F.conv1d` per request.

Speculative decoding's verify rows (requests that keep their per-token states,
`RecurrentMetadata.token_state_slots_cpu`) advance like decodes, one position at a time batched
over them (`_verify_steps`: at most 1 + k positions), storing each position's state.

Decays are summed in log space per segment (`_segsum`), so a factor exp(sum of a_r, s < r <= t)
never comes from the difference of two long prefix sums. Math is fp32 throughout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from portside.contract.recurrent import RecurrentMetadata

__all__ = ["CHUNK", "DECODE_GROUP_BYTES", "SELECTIVE_CHUNK", "causal_conv1d", "gated_delta_rule", "l2norm", "selective_scan",
           "ssd_scan"]

CHUNK = 64
"""Tokens per chunk of the Mamba-2 and gated-delta-rule prefill forms (a request of at most CHUNK
tokens is one chunk)."""
DECODE_GROUP_BYTES = 8 * 2**20
"""Decodes advance together in groups of at most this much fp32 state (whole batches of small
states; a few requests of a large one, whose copies then stay in cache)."""
SELECTIVE_CHUNK = 16
"""Tokens per chunk of the Mamba-1 scan: each of its log2(SELECTIVE_CHUNK) steps passes over a
[chunk, Dm, N] tensor, so short chunks keep the work close to the recurrence's."""


# ---- batch helpers ------------------------------------------------------------------------------


def _kept(md: RecurrentMetadata, i: int) -> list[int]:
    """Request i's slots for its per-token states (`RecurrentMetadata.token_state_slots_cpu`), or []."""
    kept = md.token_state_slots_cpu
    return kept[i] if i < len(kept) else []


def _prefills(md: RecurrentMetadata):
    """(first token, end token, slot, has initial state) per request after the decodes, less the
    verify rows (`_verify_steps`)."""
    qsl = md.query_start_loc_cpu
    for i in range(_num_decodes(md), len(qsl) - 1):
        if not _kept(md, i):
            yield qsl[i], qsl[i + 1], md.state_slots_cpu[i], md.has_initial_state_cpu[i]


def _verify_steps(state: torch.Tensor, md: RecurrentMetadata):
    """Speculative decoding's verify rows (requests that keep their per-token states), position
    by position and batched over them like decodes: for position j, (token rows [n] on the
    state's device, their states before that token as a new fp32 tensor [n, *shape]). The caller
    advances the states in place by one token; the generator then stores them in each row's
    slot for token j (`token_state_slots_cpu`, or its own slot after its last token)."""
    qsl, reqs = md.query_start_loc_cpu, []
    for i in range(_num_decodes(md), len(qsl) - 1):
        kept, n = _kept(md, i), qsl[i + 1] - qsl[i]
        if kept and len(kept) != n - 1:
            raise ValueError(f"RecurrentMetadata: request {i} has {n} tokens but {len(kept)} token state slots "
                             f"(expected {n - 1}: one after each token but the last)")  # fmt: skip
        if kept:
            reqs.append((qsl[i], n, [*kept, md.state_slots_cpu[i]], md.has_initial_state_cpu[i]))
    if not reqs:
        return
    dev = state.device
    states = torch.stack([_initial(state, dsts[-1], init) for _, _, dsts, init in reqs])
    for j in range(max(n for _, n, _, _ in reqs)):
        live = [r for r, (_, n, _, _) in enumerate(reqs) if n > j]
        at = torch.tensor(live, dtype=torch.int64, device=dev)
        h = states.index_select(0, at)
        yield torch.tensor([reqs[r][0] + j for r in live], dtype=torch.int64, device=dev), h
        states.index_copy_(0, at, h)
        dst = torch.tensor([reqs[r][2][j] for r in live], dtype=torch.int64, device=dev)
        state.index_copy_(0, dst, h.to(state.dtype))


def _num_decodes(md: RecurrentMetadata) -> int:
    nd = md.num_decodes
    if nd and md.query_start_loc_cpu[nd] != nd:
        raise ValueError(f"RecurrentMetadata: num_decodes={nd} but the first {nd} requests hold "
                         f"{md.query_start_loc_cpu[nd]} tokens (decodes have one token each and come first)")  # fmt: skip
    return nd


def _decode_groups(state: torch.Tensor, md: RecurrentMetadata):
    """The decodes, in groups of at most `DECODE_GROUP_BYTES` of fp32 state (one request at
    least): (first, end, slots [end - first] on the state's device, their states as a new fp32
    tensor [end - first, *shape]: the slots', or zeros where a request has no initial state)."""
    nd = _num_decodes(md)
    step = max(1, DECODE_GROUP_BYTES // (4 * max(1, math.prod(state.shape[1:]))))
    for lo in range(0, nd, step):
        hi = min(nd, lo + step)
        slots = md.state_slots[lo:hi].to(device=state.device, dtype=torch.int64)
        s = state.index_select(0, slots).float()  # a copy: the kernels update it in place
        fresh = [i - lo for i in range(lo, hi) if not md.has_initial_state_cpu[i]]
        if fresh:
            s.index_fill_(0, torch.tensor(fresh, device=s.device), 0.0)
        yield lo, hi, slots, s


def _initial(state: torch.Tensor, slot: int, init: bool) -> torch.Tensor:
    return state[slot].float() if init else torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)


def _chunked(length: int) -> tuple[int, int, int]:
    """(chunk length, number of chunks, padding) for a request of `length` tokens."""
    cs = max(1, min(CHUNK, length))
    nc = -(-length // cs)
    return cs, nc, nc * cs - length


def _pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    """`t` with `pad` zero rows appended along dim 0 (a padded token leaves every state unchanged:
    zero input, zero log decay)."""
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., n] -> [..., n, n]: out[..., t, s] = sum of a[..., r] for s < r <= t (t >= s), -inf above
    the diagonal, so exp(out) is the decay from token s to token t (0 where s > t)."""
    n = a.shape[-1]
    x = a.unsqueeze(-1).expand(*a.shape, n)  # x[..., r, s] = a_r
    strict = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    out = x.masked_fill(~strict, 0.0).cumsum(-2)
    return out.masked_fill(~strict.logical_or(torch.eye(n, dtype=torch.bool, device=a.device)), -math.inf)


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float] = (0.0, math.inf)):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if limit != (0.0, math.inf):
        dt = dt.clamp(limit[0], limit[1])
    return dt


# ---- causal conv1d ------------------------------------------------------------------------------


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
    b32 = None if bias is None else bias.float()

    def step(prev: torch.Tensor, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [n, C, K - 1], xt [n, C] -> (output [n, C] in x's dtype, u [n, C, K])."""
        u = torch.cat([prev, xt.float().unsqueeze(-1)], dim=2)
        y = (u * w).sum(-1) if b32 is None else (u * w).sum(-1) + b32
        return (F.silu(y) if activation == "silu" else y).to(x.dtype), u

    for lo, hi, slots, prev in _decode_groups(conv_state, md):  # prev [n, C, K - 1]
        out[lo:hi], u = step(prev, x[lo:hi])
        if K > 1:
            conv_state.index_copy_(0, slots, u[:, :, 1:].to(conv_state.dtype))
    for rows, prev in _verify_steps(conv_state, md):
        y, u = step(prev, x.index_select(0, rows))
        out.index_copy_(0, rows, y)
        prev.copy_(u[:, :, 1:])
    for a, b, slot, init in _prefills(md):
        u = torch.cat([_initial(conv_state, slot, init), x[a:b].float().t()], dim=1)  # [C, K - 1 + L]
        y = F.conv1d(u.unsqueeze(0), w.unsqueeze(1), b32, groups=x.shape[1])[0]
        if activation == "silu":
            y = F.silu(y)
        out[a:b] = y.t().to(x.dtype)
        if K > 1:
            conv_state[slot] = u[:, u.shape[1] - (K - 1):].to(conv_state.dtype)
    return out


# ---- Mamba-2 (SSD) ------------------------------------------------------------------------------


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
    D32 = None if D is None else D.float()[:, None]

    def step(h: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
        """One token of each of h's rows (h [n, H, P, N], advanced in place) -> y [n, H, P]."""
        xd, dtd = x[idx].float(), dts[idx]
        Bd, Cd = B[idx].float().repeat_interleave(rep, dim=1), C[idx].float().repeat_interleave(rep, dim=1)
        h.mul_(torch.exp(dtd * A32)[..., None, None]).addcmul_((dtd[..., None] * xd).unsqueeze(-1), Bd.unsqueeze(-2))
        out = torch.linalg.vecdot(h, Cd.unsqueeze(-2))
        return (out if D32 is None else out + D32 * xd).to(x.dtype)

    for lo, hi, slots, h in _decode_groups(ssm_state, md):  # h [n, H, P, N]
        y[lo:hi] = step(h, slice(lo, hi))
        ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
    for rows, h in _verify_steps(ssm_state, md):
        y.index_copy_(0, rows, step(h, rows))
    for a, b, slot, init in _prefills(md):
        xr = x[a:b].float()
        out, h = _ssd_chunked(xr, dts[a:b], A32, B[a:b].float(), C[a:b].float(), _initial(ssm_state, slot, init))
        y[a:b] = (out if D32 is None else out + D32 * xr).to(x.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return y


def _ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, fp32: x [L, H, P], dt [L, H] (processed), A [H], B, C [L, G, N], h [H, P, N]
    (initial state) -> (y [L, H, P] without the D term, final state [H, P, N]).

    With a_t = dt_t A and u_t = dt_t x_t, inside a chunk (decays from its start, gamma_t = sum of
    a_r for r <= t): y_t = exp(gamma_t) h0 C_t + sum_{s <= t} exp(a_{s+1} + ... + a_t) (C_t . B_s) u_s,
    and the state after the chunk is exp(gamma_end) h0 + sum_s exp(a_{s+1} + ... + a_end) u_s B_s^T."""
    L, H, P = x.shape
    G, N = B.shape[1:]
    rep = H // G
    if L == 0:
        return x.new_zeros(0, H, P), h
    cs, nc, pad = _chunked(L)
    # Heads as (group, head in group), chunks after them: [G, rep, nc, cs, ...].
    a = _pad(dt * A, pad).reshape(nc, cs, G, rep).permute(2, 3, 0, 1)
    u = _pad(dt.unsqueeze(-1) * x, pad).reshape(nc, cs, G, rep, P).permute(2, 3, 0, 1, 4)
    Bc, Cc = (_pad(t, pad).reshape(nc, cs, G, 1, N).permute(2, 3, 0, 1, 4) for t in (B, C))  # [G, 1, nc, cs, N]
    seg = _segsum(a)  # [G, rep, nc, cs, cs]
    gamma = a.cumsum(-1)  # [G, rep, nc, cs]
    out = ((Cc @ Bc.transpose(-1, -2)) * seg.exp()) @ u  # intra-chunk: [G, rep, nc, cs, P]
    # Each chunk's own contribution to the state after it, then the states entering each chunk.
    local = (u * seg[..., -1, :].exp().unsqueeze(-1)).transpose(-1, -2) @ Bc  # [G, rep, nc, P, N]
    chunk_decay = gamma[..., -1].exp()  # [G, rep, nc]
    state, entering = h.reshape(G, rep, P, N), []
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[..., c, None, None] + local[:, :, c]
    out = out + (Cc @ torch.stack(entering, 2).transpose(-1, -2)) * gamma.exp().unsqueeze(-1)
    return out.permute(2, 3, 0, 1, 4).reshape(nc * cs, H, P)[:L], state.reshape(H, P, N)


# ---- Mamba-1 ------------------------------------------------------------------------------------


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
    xf = x.float()
    outs: list[tuple[int, int, torch.Tensor]] = []

    def step(h: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
        """One token of each of h's rows (h [n, Dm, N], advanced in place) -> y [n, Dm] (fp32, D and gate to add)."""
        h.mul_(torch.exp(dts[idx][:, :, None] * A32)).addcmul_((dts[idx] * xf[idx])[:, :, None], B[idx].float()[:, None, :])
        return torch.linalg.vecdot(h, C[idx].float().unsqueeze(-2))

    def finish(out: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
        if D is not None:
            out = out + D.float() * xf[idx]
        if z is not None:
            out = out * F.silu(z[idx].float())
        return out.to(x.dtype)

    for lo, hi, slots, h in _decode_groups(ssm_state, md):  # h [n, Dm, N]
        outs.append((lo, hi, step(h, slice(lo, hi))))
        ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
    for rows, h in _verify_steps(ssm_state, md):
        y.index_copy_(0, rows, finish(step(h, rows), rows))
    for a, b, slot, init in _prefills(md):
        out, h = _selective_chunked(xf[a:b], dts[a:b], A32, B[a:b].float(), C[a:b].float(), _initial(ssm_state, slot, init))
        outs.append((a, b, out))
        ssm_state[slot] = h.to(ssm_state.dtype)
    for a, b, out in outs:
        y[a:b] = finish(out, slice(a, b))
    return y


def _selective_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, fp32: x, dt [L, Dm] (dt processed), A [Dm, N], B, C [L, N], h [Dm, N] ->
    (y [L, Dm] without the D term and the gate, final state [Dm, N]). Per chunk of
    `SELECTIVE_CHUNK` tokens, an inclusive scan of (decay, input) pairs, h_t = a_t h_{t-1} + b_t,
    in log2(chunk) vectorised steps; the state is carried from chunk to chunk."""
    L = x.shape[0]
    out = torch.empty_like(x)
    for s in range(0, L, SELECTIVE_CHUNK):
        e = min(L, s + SELECTIVE_CHUNK)
        a = torch.exp(dt[s:e, :, None] * A)  # [n, Dm, N]
        b = (dt[s:e] * x[s:e])[:, :, None] * B[s:e, None, :]
        b[0].addcmul_(a[0], h)
        shift, n = 1, e - s
        while shift < n:  # after this step b[t] holds the inputs of tokens t - 2 * shift < r <= t, decayed to t
            b[shift:].addcmul_(a[shift:], b[:-shift].clone())
            if 2 * shift < n:
                a[shift:] = a[shift:] * a[:-shift]
            shift *= 2
        out[s:e] = torch.linalg.vecdot(b, C[s:e, None, :])
        h = b[-1]
    return out, h


# ---- gated delta rule ---------------------------------------------------------------------------


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

    def step(S: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
        """One token of each of S's rows (S [n, Hv, K, V], advanced in place) -> o [n, Hv, V]."""
        S.mul_(torch.exp(gf[idx])[..., None, None])
        kv_mem = (kf[idx].unsqueeze(-2) @ S).squeeze(-2)  # [n, Hv, V]
        S.addcmul_(kf[idx].unsqueeze(-1), ((vf[idx] - kv_mem) * bf[idx][:, :, None]).unsqueeze(-2))
        return (qf[idx].unsqueeze(-2) @ S).squeeze(-2).to(v.dtype)

    for lo, hi, slots, S in _decode_groups(state, md):  # S [n, Hv, K, V]
        o[lo:hi] = step(S, slice(lo, hi))
        state.index_copy_(0, slots, S.to(state.dtype))
    for rows, S in _verify_steps(state, md):
        o.index_copy_(0, rows, step(S, rows))
    for a, b, slot, init in _prefills(md):
        out, S = _gdr_chunked(qf[a:b], kf[a:b], vf[a:b], gf[a:b], bf[a:b], _initial(state, slot, init))
        o[a:b] = out.to(v.dtype)
        state[slot] = S.to(state.dtype)
    return o


def _diagonal_blocks(X: torch.Tensor, size: int) -> torch.Tensor:
    """The diagonal `size` x `size` blocks of X [..., m, m] (m a multiple of size), as a view
    [..., m // size, size, size]."""
    k = X.shape[-1] // size
    return X.unflatten(-1, (k, size)).unflatten(-3, (k, size)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., n, n] strictly lower triangular, with matmuls only (any torch device):
    the inverses of diagonal blocks of size b give those of size 2b, [[X, 0], [Y, Z]]^-1 =
    [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]], from b = 1 up to n (padded to a power of two with I)."""
    n = A.shape[-1]
    m = 1 << (n - 1).bit_length()
    M = F.pad(A, (0, m - n, 0, m - n))
    inv = torch.eye(m, dtype=A.dtype, device=A.device).expand(M.shape).clone()  # a copy: XLA keeps contiguous() a view
    b = 1
    while b < m:
        Mb, Ib = _diagonal_blocks(M, 2 * b), _diagonal_blocks(inv, 2 * b)
        Ib[..., b:, :b] = -(Ib[..., b:, b:] @ Mb[..., b:, :b] @ Ib[..., :b, :b])
        b *= 2
    return inv[..., :n, :n]


def _gdr_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, fp32, heads expanded: q, k [L, H, K] (normalised, q scaled), v [L, H, V], g, beta
    [L, H], S [H, K, V] (initial state) -> (o [L, H, V], final state [H, K, V]).

    Inside a chunk, with gamma_t the summed log decay from its start and S0 the entering state,
    the delta-rule corrections u_t = beta_t (v_t - k_t^T S_{t, before the update}) solve the unit
    lower triangular system (I + A) U = beta V - diag(beta exp(gamma)) K S0 with
    A[t, s] = beta_t exp(g_{s+1} + ... + g_t) k_t . k_s (s < t); then
    o_t = exp(gamma_t) q_t S0 + sum_{s <= t} exp(g_{s+1} + ... + g_t) (q_t . k_s) u_s and the state
    after the chunk is exp(gamma_end) S0 + sum_s exp(g_{s+1} + ... + g_end) k_s u_s^T."""
    L, H = k.shape[:2]
    Vd = v.shape[-1]
    cs, nc, pad = _chunked(L)
    # Chunk-major, contiguous: [nc, H, cs, *].
    q, k, v = (_pad(t, pad).reshape(nc, cs, H, -1).transpose(1, 2).contiguous() for t in (q, k, v))
    g, beta = (_pad(t, pad).reshape(nc, cs, H).transpose(1, 2).contiguous() for t in (g, beta))  # [nc, H, cs]
    seg = _segsum(g)
    decay = seg.exp()  # [nc, H, cs, cs], 0 above the diagonal
    gamma = g.cumsum(-1)
    kb = k * beta.unsqueeze(-1)
    T = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))
    w = T @ (v * beta.unsqueeze(-1))  # [nc, H, cs, V]
    kd = T @ (kb * gamma.exp().unsqueeze(-1))  # [nc, H, cs, K]
    qk = (q @ k.transpose(-1, -2)) * decay
    qd = q * gamma.exp().unsqueeze(-1)
    k_end = (k * seg[..., -1, :].exp().unsqueeze(-1)).transpose(-1, -2).contiguous()  # [nc, H, K, cs]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [nc, H, 1, 1]
    out = q.new_empty(nc, H, cs, Vd)
    for c in range(nc):
        u = w[c] - kd[c] @ S
        out[c] = qd[c] @ S + qk[c] @ u
        S = S * chunk_decay[c] + k_end[c] @ u
    return out.transpose(1, 2).reshape(nc * cs, H, Vd)[:L], S
