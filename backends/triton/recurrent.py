"""Recurrent-layer kernels for cuda/rocm: `portside.contract.RecurrentKernels` (causal conv1d,
the Mamba-2 and Mamba-1 selective scans, the gated delta rule) as Triton kernels, written afresh
against core's references in `portside.ops.recurrent` (batch layout, state slots and dtypes in
`portside.contract.recurrent`).

Every kernel reads the step's requests from the device tensors of `RecurrentMetadata`
(``query_start_loc``, ``state_slots``, ``has_initial_state``); grids are bounds from shapes, so
nothing is read back to the host and a CUDA/HIP graph can capture a decode step. Math is fp32;
outputs are stored in the input's dtype and states in their tensors' dtype. Operands are read
through their strides (x may be a column slice of a projection's output).

- `causal_conv1d`: one program per (BLOCK_T tokens, BLOCK_C channels) of the flat batch, each
  token's request found by a binary search of ``query_start_loc``; the K taps read x, or the
  slot's state for positions before the request's first token. A second launch, one program per
  (request, channel block), then writes each slot's last K - 1 inputs (after every output has
  read the old state). A batch of decodes only takes one fused launch (output and state shift).
- `ssd_scan` (Mamba-2), `selective_scan` (Mamba-1) and `gated_delta_rule`: one program per
  (request, head, block of the head's state), the state block in registers from the slot to the
  request's end; the kernels are in `recurrent_scans`. Steps with prefills take the chunked forms
  of Mamba-2 and the gated delta rule (`CHUNK` tokens a step, matmuls); decode steps, and Mamba-1
  always, go a token at a time. q and k of the delta rule are l2-normalised inside (over all of K).

Each program reads its slot's state before its first store to it (`tl.debug_barrier` in between).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from portside.backends.triton.recurrent_scans import (
    gdn_chunk_kernel,
    gdn_step_kernel,
    selective_kernel,
    ssd_chunk_kernel,
    ssd_step_kernel,
)
from portside.contract import RecurrentMetadata

__all__ = ["causal_conv1d", "gated_delta_rule", "selective_scan", "ssd_scan", "TritonRecurrentOps"]

STATE_TILE = 4096  # fp32 state elements a program keeps in registers (32 a thread at 4 warps)
CHUNK = 32  # tokens per step of the chunked scans (a power of two, >= MIN_DOT)
MIN_DOT = 16  # smallest tl.dot side a GPU accepts


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def _request_of(qsl_ptr, tok, num_reqs, STEPS: tl.constexpr):
    """The largest request i < num_reqs with qsl[i] <= tok, per token (binary search)."""
    lo = tl.zeros_like(tok)
    hi = lo + num_reqs
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(qsl_ptr + mid) <= tok
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


# ----------------------------------------------------------------------------- causal conv1d


@triton.jit
def _conv_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
                 num_tokens, num_reqs, C, sx_t, sx_c, sw_c, sw_k, ss_s, ss_c, ss_k, so_t, so_c,
                 KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, STEPS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = toks < num_tokens
    c_ok = chans < C
    req = _request_of(qsl_ptr, toks, num_reqs, STEPS)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    init = tl.load(init_ptr + req) != 0
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KW):
        pos = toks - (KW - 1) + j  # the input this tap reads: x when in the request, else the state
        in_x = pos >= start
        val = tl.load(x_ptr + pos[:, None] * sx_t + chans[None, :] * sx_c,
                      mask=(t_ok & in_x)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if j < KW - 1:
            col = pos - start + (KW - 1)
            val += tl.load(state_ptr + slot[:, None] * ss_s + chans[None, :] * ss_c + col[:, None] * ss_k,
                           mask=(t_ok & ~in_x & init)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + chans * sw_c + j * sw_k, mask=c_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * val
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + toks[:, None] * so_t + chans[None, :] * so_c, acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])  # fmt: skip


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr, C, sx_t, sx_c, ss_s, ss_c, ss_k,
                       KW: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Slot of request r <- the last K - 1 inputs of (old state or zeros, the request's tokens)."""
    r = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = chans < C
    start = tl.load(qsl_ptr + r).to(tl.int64)
    end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r) != 0
    js = tl.arange(0, BLOCK_J)
    j_ok = js < KW - 1
    pos = end - (KW - 1) + js
    in_x = pos >= start
    base = state_ptr + slot * ss_s + chans[:, None] * ss_c
    new = tl.load(x_ptr + pos[None, :] * sx_t + chans[:, None] * sx_c,
                  mask=c_ok[:, None] & (j_ok & in_x)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    new += tl.load(base + (js + (end - start))[None, :] * ss_k,
                   mask=c_ok[:, None] & (j_ok & ~in_x & init)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    tl.debug_barrier()
    tl.store(base + js[None, :] * ss_k, new.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & j_ok[None, :])


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
                        C, sx_t, sx_c, sw_c, sw_k, ss_s, ss_c, ss_k, so_t, so_c,
                        KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """One-token requests: output and state shift in one program per (request, channel block)."""
    r = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = chans < C
    tok = tl.load(qsl_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r) != 0
    js = tl.arange(0, BLOCK_J)
    j_ok = js < KW - 1
    base = state_ptr + slot * ss_s + chans[:, None] * ss_c
    prev = tl.load(base + js[None, :] * ss_k, mask=c_ok[:, None] & j_ok[None, :] & init, other=0.0).to(tl.float32)
    after = tl.load(base + (js + 1)[None, :] * ss_k, mask=c_ok[:, None] & (js + 1 < KW - 1)[None, :] & init,
                    other=0.0).to(tl.float32)  # fmt: skip
    xv = tl.load(x_ptr + tok * sx_t + chans * sx_c, mask=c_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + chans[:, None] * sw_c + js[None, :] * sw_k, mask=c_ok[:, None] & j_ok[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    w_last = tl.load(w_ptr + chans * sw_c + (KW - 1) * sw_k, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w * prev, axis=1) + w_last * xv
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tok * so_t + chans * so_c, acc.to(out_ptr.dtype.element_ty), mask=c_ok)
    new = tl.where((js == KW - 2)[None, :], xv[:, None], after)
    tl.debug_barrier()
    tl.store(base + js[None, :] * ss_k, new.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & j_ok[None, :])


def _meta(md: RecurrentMetadata):
    return md.query_start_loc, md.state_slots, md.has_initial_state


def _decodes_only(md: RecurrentMetadata, num_tokens: int) -> bool:
    """Every request has one token (a decode step): the one-token kernels."""
    return md.num_decodes == md.query_start_loc.shape[0] - 1 == num_tokens


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  md: RecurrentMetadata, activation: str | None = "silu") -> torch.Tensor:
    """`portside.ops.recurrent.causal_conv1d`: x [T, C], weight [C, K], conv_state [slots, C, K - 1]."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation {activation!r}; expected 'silu' or None")
    num_tokens, chans = x.shape
    kw = weight.shape[1]
    num_reqs = md.query_start_loc.shape[0] - 1
    out = torch.empty((num_tokens, chans), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    qsl, slots, init = _meta(md)
    block_c = min(64, _p2(chans))
    block_j = max(2, _p2(kw - 1))  # tl.arange of at least 2
    strides = (*x.stride(), *weight.stride(), *conv_state.stride(), *out.stride())
    bias_arg = bias if bias is not None else weight
    if _decodes_only(md, num_tokens) and kw > 1:
        _conv_decode_kernel[(num_reqs, triton.cdiv(chans, block_c))](
            x, weight, bias_arg, conv_state, out, qsl, slots, init, chans, *strides,
            KW=kw, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_J=block_j, BLOCK_C=block_c)  # fmt: skip
        return out
    block_t = max(16, min(64, _p2(num_tokens)))
    _conv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(chans, block_c))](
        x, weight, bias_arg, conv_state, out, qsl, slots, init, num_tokens, num_reqs, chans, *strides,
        KW=kw, HAS_BIAS=bias is not None, SILU=activation == "silu", STEPS=max(1, num_reqs.bit_length()),
        BLOCK_T=block_t, BLOCK_C=block_c)  # fmt: skip
    if kw > 1:
        _conv_state_kernel[(num_reqs, triton.cdiv(chans, block_c))](
            x, conv_state, qsl, slots, init, chans, *x.stride(), *conv_state.stride(),
            KW=kw, BLOCK_J=block_j, BLOCK_C=block_c)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- Mamba-2 (SSD)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
             dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
             dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """`portside.ops.recurrent.ssd_scan`: x [T, H, P], dt [T, H], A [H], B, C [T, G, N], ssm_state [slots, H, P, N]."""
    num_tokens, heads, p = x.shape
    groups, n = B.shape[1], B.shape[2]
    num_reqs = md.query_start_loc.shape[0] - 1
    y = torch.empty((num_tokens, heads, p), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_reqs == 0:
        return y
    qsl, slots, init = _meta(md)
    chunked = not _decodes_only(md, num_tokens)
    lo = MIN_DOT if chunked else 1
    block_n = max(lo, _p2(n))
    block_p = max(lo, min(_p2(p), STATE_TILE // block_n, 32))
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    has_limit = tuple(dt_limit) != (0.0, math.inf)
    kernel, extra = (ssd_chunk_kernel, {"BT": CHUNK}) if chunked else (ssd_step_kernel, {})
    kernel[(num_reqs, heads, triton.cdiv(p, block_p))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, ssm_state, y, qsl, slots, init,
        p, n, heads // groups, *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_state.stride(), *y.stride(),
        float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        BLOCK_P=block_p, BLOCK_N=block_n, **extra)  # fmt: skip
    return y


# ----------------------------------------------------------------------------- Mamba-1


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = True) -> torch.Tensor:
    """`portside.ops.recurrent.selective_scan`: x, dt [T, Dm], A [Dm, N], B, C [T, N], ssm_state [slots, Dm, N]."""
    num_tokens, dm = x.shape
    n = A.shape[1]
    num_reqs = md.query_start_loc.shape[0] - 1
    y = torch.empty((num_tokens, dm), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_reqs == 0:
        return y
    qsl, slots, init = _meta(md)
    block_n = _p2(n)
    block_d = max(1, min(_p2(dm), STATE_TILE // block_n, 64))
    D = D.contiguous() if D is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    z_strides = z.stride() if z is not None else (0, 0)
    selective_kernel[(num_reqs, triton.cdiv(dm, block_d))](
        x, dt, A, B, C, D if D is not None else A, z if z is not None else x, dt_bias if dt_bias is not None else A,
        ssm_state, y, qsl, slots, init, dm, n, *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *z_strides, *ssm_state.stride(), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        BLOCK_D=block_d, BLOCK_N=block_n)  # fmt: skip
    return y


# ----------------------------------------------------------------------------- gated delta rule


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, md: RecurrentMetadata, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """`portside.ops.recurrent.gated_delta_rule`: q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv], state [slots, Hv, K, V]."""
    num_tokens, hv, vd = v.shape
    hk, kd = q.shape[1], q.shape[2]
    num_reqs = md.query_start_loc.shape[0] - 1
    o = torch.empty((num_tokens, hv, vd), dtype=v.dtype, device=v.device)
    if num_tokens == 0 or num_reqs == 0:
        return o
    qsl, slots, init = _meta(md)
    chunked = not _decodes_only(md, num_tokens)
    lo = MIN_DOT if chunked else 1
    block_k = max(lo, _p2(kd))
    block_v = max(lo, min(_p2(vd), STATE_TILE // block_k, 32))
    kernel, extra = (gdn_chunk_kernel, {"BT": CHUNK, "LOG2_BT": CHUNK.bit_length() - 1}) if chunked else (gdn_step_kernel, {})
    kernel[(num_reqs, hv, triton.cdiv(vd, block_v))](
        q, k, v, g, beta, state, o, qsl, slots, init, kd, vd, hv // hk, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(), *o.stride(),
        L2NORM=use_qk_l2norm, BLOCK_K=block_k, BLOCK_V=block_v, **extra)  # fmt: skip
    return o


class TritonRecurrentOps:
    """`ModelOps` mixin: the recurrent-layer kernels (`portside.contract.RecurrentKernels`) as
    the Triton kernels above."""

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      md: RecurrentMetadata, activation: str | None = "silu") -> torch.Tensor:  # fmt: skip
        return causal_conv1d(x, weight, bias, conv_state, md, activation)

    def ssd_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                 dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:  # fmt: skip
        return ssd_scan(x, dt, A, B, C, ssm_state, md, D, dt_bias, dt_softplus, dt_limit)

    def selective_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       ssm_state: torch.Tensor, md: RecurrentMetadata, D: torch.Tensor | None = None,
                       z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                       dt_softplus: bool = True) -> torch.Tensor:  # fmt: skip
        return selective_scan(x, dt, A, B, C, ssm_state, md, D, z, dt_bias, dt_softplus)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, md: RecurrentMetadata, scale: float,
                         use_qk_l2norm: bool = True) -> torch.Tensor:  # fmt: skip
        return gated_delta_rule(q, k, v, g, beta, state, md, scale, use_qk_l2norm)
