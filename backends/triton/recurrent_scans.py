"""The scan kernels behind `portside.backends.triton.recurrent` (launchers, conventions and the
`ModelOps` mixin there): Mamba-2 (SSD), Mamba-1 and the gated delta rule.

One program per (request, head, block of the head's state); the program keeps its block of the
state in registers (fp32) from the slot's (or zeros) to the request's end, then stores it.

- ``*_step_kernel``: one token at a time. The decode path (one token per request), and Mamba-1's
  only form (its decay differs per channel and state entry: no matmul form).
- ``*_chunk_kernel``: ``BT`` tokens at a time, as matmuls (``tl.dot``, fp32 "ieee"). With gamma the
  within-chunk cumulative log decay and ``L[t, s] = exp(gamma_t - gamma_s)`` for ``s <= t`` (0 above),
  SSD: ``y = ((C B^T) * L) (dt x) + exp(gamma) (C h^T)``, then
  ``h = exp(gamma_end) h + (dt x * exp(gamma_end - gamma))^T B``; the gated delta rule solves the
  chunk's unit lower-triangular system for the corrections U (``(I + A)^-1`` as a product of
  ``log2(BT)`` factors, matmuls only), as core's chunked reference does. Tokens past the request's
  end are masked to a zero input and a zero log decay, so they leave the state as it was.

`tl.debug_barrier` before the final store: the old state's loads happen before any thread
overwrites it (a program's threads may hold a tile in different layouts).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["gdn_chunk_kernel", "gdn_step_kernel", "selective_kernel", "ssd_chunk_kernel", "ssd_step_kernel"]


@triton.jit
def _dt(dt, dtb, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """dt + dt_bias, softplus (F.softplus: threshold 20), clamp: the references' `_dt`."""
    if HAS_DT_BIAS:
        dt += dtb
    if SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _request(qsl_ptr, slots_ptr, init_ptr, r):
    start = tl.load(qsl_ptr + r).to(tl.int64)
    end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    return start, end, tl.load(slots_ptr + r).to(tl.int64), tl.load(init_ptr + r) != 0


# ---- Mamba-2 (SSD) --------------------------------------------------------------------------------


@triton.jit
def ssd_step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, state_ptr, y_ptr, qsl_ptr, slots_ptr, init_ptr,
                    P, N, heads_per_group, sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
                    ss_s, ss_h, ss_p, ss_n, sy_t, sy_h, sy_p, dt_min, dt_max,
                    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    p_ok, n_ok = ps < P, ns < N
    g = h // heads_per_group
    start, end, slot, init = _request(qsl_ptr, slots_ptr, init_ptr, r)
    state_ptrs = state_ptr + slot * ss_s + h * ss_h + ps[:, None] * ss_p + ns[None, :] * ss_n
    s_ok = p_ok[:, None] & n_ok[None, :]
    hs = tl.load(state_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32) if HAS_D else 0.0
    dtb = tl.load(dtb_ptr + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    for t in range(start, end):
        dt = _dt(tl.load(dt_ptr + t * sdt_t + h * sdt_h).to(tl.float32), dtb, dt_min, dt_max, HAS_DT_BIAS, SOFTPLUS,
                 HAS_LIMIT)  # fmt: skip
        xv = tl.load(x_ptr + t * sx_t + h * sx_h + ps * sx_p, mask=p_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + t * sb_t + g * sb_g + ns * sb_n, mask=n_ok, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * sc_t + g * sc_g + ns * sc_n, mask=n_ok, other=0.0).to(tl.float32)
        hs = hs * tl.exp(dt * a) + (dt * xv)[:, None] * bv[None, :]
        yv = tl.sum(hs * cv[None, :], axis=1)
        if HAS_D:
            yv += d * xv
        tl.store(y_ptr + t * sy_t + h * sy_h + ps * sy_p, yv.to(y_ptr.dtype.element_ty), mask=p_ok)
    tl.debug_barrier()
    tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=s_ok)


@triton.jit
def ssd_chunk_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, state_ptr, y_ptr, qsl_ptr, slots_ptr, init_ptr,
                     P, N, heads_per_group, sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
                     ss_s, ss_h, ss_p, ss_n, sy_t, sy_h, sy_p, dt_min, dt_max,
                     HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, BT)
    p_ok, n_ok = ps < P, ns < N
    causal = ts[:, None] >= ts[None, :]
    g = h // heads_per_group
    start, end, slot, init = _request(qsl_ptr, slots_ptr, init_ptr, r)
    state_ptrs = state_ptr + slot * ss_s + h * ss_h + ps[:, None] * ss_p + ns[None, :] * ss_n
    s_ok = p_ok[:, None] & n_ok[None, :]
    hs = tl.load(state_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32) if HAS_D else 0.0
    dtb = tl.load(dtb_ptr + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    for c0 in range(start, end, BT):
        t = c0 + ts
        t_ok = t < end
        dt = _dt(tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=t_ok, other=0.0).to(tl.float32), dtb, dt_min, dt_max,
                 HAS_DT_BIAS, SOFTPLUS, HAS_LIMIT)  # fmt: skip
        dt = tl.where(t_ok, dt, 0.0)
        xc = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + ps[None, :] * sx_p, mask=t_ok[:, None] & p_ok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        bc = tl.load(b_ptr + t[:, None] * sb_t + g * sb_g + ns[None, :] * sb_n, mask=t_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        cc = tl.load(c_ptr + t[:, None] * sc_t + g * sc_g + ns[None, :] * sc_n, mask=t_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        gam = tl.cumsum(dt * a, axis=0)  # [BT]
        decay = tl.exp(tl.where(causal, gam[:, None] - gam[None, :], float("-inf")))
        u = xc * dt[:, None]  # [BT, BLOCK_P]
        yc = tl.dot(tl.dot(cc, tl.trans(bc), input_precision="ieee") * decay, u, input_precision="ieee")
        yc += tl.exp(gam)[:, None] * tl.dot(cc, tl.trans(hs), input_precision="ieee")
        if HAS_D:
            yc += d * xc
        tl.store(y_ptr + t[:, None] * sy_t + h * sy_h + ps[None, :] * sy_p, yc.to(y_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & p_ok[None, :])  # fmt: skip
        g_end = tl.sum(dt * a, axis=0)
        hs = hs * tl.exp(g_end) + tl.dot(tl.trans(u * tl.exp(g_end - gam)[:, None]), bc, input_precision="ieee")
    tl.debug_barrier()
    tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=s_ok)


# ---- Mamba-1 ---------------------------------------------------------------------------------------


@triton.jit
def selective_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, state_ptr, y_ptr,
                     qsl_ptr, slots_ptr, init_ptr, DM, N, sx_t, sx_d, sdt_t, sdt_d, sa_d, sa_n, sb_t, sb_n,
                     sc_t, sc_n, sz_t, sz_d, ss_s, ss_d, ss_n, sy_t, sy_d,
                     HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    d_ok, n_ok = ds < DM, ns < N
    s_ok = d_ok[:, None] & n_ok[None, :]
    start, end, slot, init = _request(qsl_ptr, slots_ptr, init_ptr, r)
    state_ptrs = state_ptr + slot * ss_s + ds[:, None] * ss_d + ns[None, :] * ss_n
    hs = tl.load(state_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + ds[:, None] * sa_d + ns[None, :] * sa_n, mask=s_ok, other=0.0).to(tl.float32)
    dd = tl.load(d_ptr + ds, mask=d_ok, other=0.0).to(tl.float32) if HAS_D else 0.0
    dtb = tl.load(dtb_ptr + ds, mask=d_ok, other=0.0).to(tl.float32) if HAS_DT_BIAS else 0.0
    for t in range(start, end):
        dt = _dt(tl.load(dt_ptr + t * sdt_t + ds * sdt_d, mask=d_ok, other=0.0).to(tl.float32), dtb, 0.0, 0.0,
                 HAS_DT_BIAS, SOFTPLUS, False)  # fmt: skip
        xv = tl.load(x_ptr + t * sx_t + ds * sx_d, mask=d_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + t * sb_t + ns * sb_n, mask=n_ok, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * sc_t + ns * sc_n, mask=n_ok, other=0.0).to(tl.float32)
        hs = tl.exp(dt[:, None] * a) * hs + (dt * xv)[:, None] * bv[None, :]
        yv = tl.sum(hs * cv[None, :], axis=1)
        if HAS_D:
            yv += dd * xv
        if HAS_Z:
            zv = tl.load(z_ptr + t * sz_t + ds * sz_d, mask=d_ok, other=0.0).to(tl.float32)
            yv = yv * (zv * tl.sigmoid(zv))
        tl.store(y_ptr + t * sy_t + ds * sy_d, yv.to(y_ptr.dtype.element_ty), mask=d_ok)
    tl.debug_barrier()
    tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=s_ok)


# ---- gated delta rule ------------------------------------------------------------------------------


@triton.jit
def _l2norm_rows(x, L2NORM: tl.constexpr):
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)
    return x


@triton.jit
def gdn_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, init_ptr,
                    K, V, rep, scale, sq_t, sq_h, sq_k, sk_t, sk_h, sk_k, sv_t, sv_h, sv_v, sg_t, sg_h, sbt_t, sbt_h,
                    ss_s, ss_h, ss_k, ss_v, so_t, so_h, so_v,
                    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    r, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // rep
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = ks < K, vs < V
    s_ok = k_ok[:, None] & v_ok[None, :]
    start, end, slot, init = _request(qsl_ptr, slots_ptr, init_ptr, r)
    state_ptrs = state_ptr + slot * ss_s + hv * ss_h + ks[:, None] * ss_k + vs[None, :] * ss_v
    S = tl.load(state_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    for t in range(start, end):
        qv = _l2norm_rows(tl.load(q_ptr + t * sq_t + hk * sq_h + ks * sq_k, mask=k_ok, other=0.0).to(tl.float32), L2NORM)
        kv = _l2norm_rows(tl.load(k_ptr + t * sk_t + hk * sk_h + ks * sk_k, mask=k_ok, other=0.0).to(tl.float32), L2NORM)
        vv = tl.load(v_ptr + t * sv_t + hv * sv_h + vs * sv_v, mask=v_ok, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + t * sg_t + hv * sg_h).to(tl.float32)
        bv = tl.load(beta_ptr + t * sbt_t + hv * sbt_h).to(tl.float32)
        S = S * tl.exp(gv)
        delta = (vv - tl.sum(S * kv[:, None], axis=0)) * bv
        S = S + kv[:, None] * delta[None, :]
        ov = tl.sum(S * (qv * scale)[:, None], axis=0)
        tl.store(o_ptr + t * so_t + hv * so_h + vs * so_v, ov.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.debug_barrier()
    tl.store(state_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_ok)


@triton.jit
def gdn_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, init_ptr,
                     K, V, rep, scale, sq_t, sq_h, sq_k, sk_t, sk_h, sk_k, sv_t, sv_h, sv_v, sg_t, sg_h, sbt_t, sbt_h,
                     ss_s, ss_h, ss_k, ss_v, so_t, so_h, so_v,
                     L2NORM: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr):  # fmt: skip
    r, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // rep
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ts = tl.arange(0, BT)
    k_ok, v_ok = ks < K, vs < V
    s_ok = k_ok[:, None] & v_ok[None, :]
    causal = ts[:, None] >= ts[None, :]
    eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    start, end, slot, init = _request(qsl_ptr, slots_ptr, init_ptr, r)
    state_ptrs = state_ptr + slot * ss_s + hv * ss_h + ks[:, None] * ss_k + vs[None, :] * ss_v
    S = tl.load(state_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    for c0 in range(start, end, BT):
        t = c0 + ts
        t_ok = t < end
        tk_ok = t_ok[:, None] & k_ok[None, :]
        qc = _l2norm_rows(tl.load(q_ptr + t[:, None] * sq_t + hk * sq_h + ks[None, :] * sq_k, mask=tk_ok,
                                  other=0.0).to(tl.float32), L2NORM) * scale  # fmt: skip
        kc = _l2norm_rows(tl.load(k_ptr + t[:, None] * sk_t + hk * sk_h + ks[None, :] * sk_k, mask=tk_ok,
                                  other=0.0).to(tl.float32), L2NORM)  # fmt: skip
        vc = tl.load(v_ptr + t[:, None] * sv_t + hv * sv_h + vs[None, :] * sv_v, mask=t_ok[:, None] & v_ok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        gc = tl.load(g_ptr + t * sg_t + hv * sg_h, mask=t_ok, other=0.0).to(tl.float32)
        bc = tl.load(beta_ptr + t * sbt_t + hv * sbt_h, mask=t_ok, other=0.0).to(tl.float32)
        gam = tl.cumsum(gc, axis=0)
        decay = tl.exp(tl.where(causal, gam[:, None] - gam[None, :], float("-inf")))  # [BT, BT]
        kb = kc * bc[:, None]
        A = tl.where(ts[:, None] > ts[None, :], tl.dot(kb, tl.trans(kc), input_precision="ieee") * decay, 0.0)
        inv = eye - A  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... (A is nilpotent: A^BT = 0)
        power = A
        for _ in tl.static_range(LOG2_BT - 1):
            power = tl.dot(power, power, input_precision="ieee")
            inv += tl.dot(inv, power, input_precision="ieee")
        kd = tl.dot(inv, kb * tl.exp(gam)[:, None], input_precision="ieee")  # [BT, BLOCK_K]
        u = tl.dot(inv, vc * bc[:, None], input_precision="ieee") - tl.dot(kd, S, input_precision="ieee")
        oc = tl.dot(qc * tl.exp(gam)[:, None], S, input_precision="ieee")
        oc += tl.dot(tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay, u, input_precision="ieee")
        tl.store(o_ptr + t[:, None] * so_t + hv * so_h + vs[None, :] * so_v, oc.to(o_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & v_ok[None, :])  # fmt: skip
        g_end = tl.sum(gc, axis=0)
        S = S * tl.exp(g_end) + tl.dot(tl.trans(kc * tl.exp(g_end - gam)[:, None]), u, input_precision="ieee")
    tl.debug_barrier()
    tl.store(state_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_ok)
