// The recurrent layers' kernels (portside.contract.RecurrentKernels) as torch operators, for the
// cpu backend's ModelOps (recurrent.py). Semantics, shapes and the batch layout are those of core's
// references (portside.ops.recurrent); each request's tokens are query_start_loc[i]:[i + 1], it
// starts from slot state_slots[i] when has_initial_state[i] (else zeros) and leaves its state there.
//
//   portside_cpu_native::causal_conv1d(x [T, C], weight [C, K], bias [C]?, conv_state! [S, C, K-1], qsl, slots,
//                                      init, bool silu) -> [T, C]
//   portside_cpu_native::ssd_scan(x [T, H, P], dt [T, H], A [H], B [T, G, N], C [T, G, N], ssm_state! [S, H, P, N],
//                                 qsl, slots, init, D [H]?, dt_bias [H]?, dt_softplus, dt_min, dt_max) -> [T, H, P]
//   portside_cpu_native::selective_scan(x [T, Dm], dt [T, Dm], A [Dm, N], B [T, N], C [T, N], ssm_state! [S, Dm, N],
//                                       qsl, slots, init, D [Dm]?, z [T, Dm]?, dt_bias [Dm]?, dt_softplus) -> [T, Dm]
//   portside_cpu_native::gated_delta_rule(q [T, Hk, K], k [T, Hk, K], v [T, Hv, V], g [T, Hv], beta [T, Hv],
//                                         state! [S, Hv, K, V], qsl, slots, init, scale, use_qk_l2norm) -> [T, Hv, V]
//   portside_cpu_native::recurrent_vector_width() -> int: the fp32 lanes of the vectors compiled in (16: AVX-512).
//
// x, B, C, q, k, v, z are fp32 or bf16 (read in place, any strides but a unit last one); the
// small operands (weights, dt, A, D, g, beta) are converted to fp32 by ATen first (dt's bias,
// softplus and clamp too: the reference's own ops); states are fp32 or bf16, any strides. Math is
// fp32; outputs in x's (v's) dtype.
//
// Each kernel is a set of independent tasks run by OpenMP threads, longest first: a request's
// channel block (conv: its tokens one after another through a ring of its K last inputs), or a
// request's (head, block of state rows) whose state stays in L1 while its tokens run in order
// (Mamba-2: P rows of N; Mamba-1: rows of N; gated delta rule: a block of 2 vectors of V columns
// of the K x V state, every column being independent of the others). Rows are padded to whole
// vectors (GCC vector extensions; 16 lanes with AVX-512, else 8) with zeros that stay zero.
// Helpers (vectors, bf16, state slots, the task loop) in recurrent.h.

#include "recurrent.h"

#include <ATen/ops/clamp.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softplus.h>
#include <torch/library.h>

namespace {

using namespace portside_recurrent;

// ---------------------------------------------------------------------------------------------
// causal depthwise conv1d: a task is a request's block of CB channels; its window of the K last
// inputs is a ring of K rows (the slot's K - 1 columns first).

constexpr int64_t CB = 64;

at::Tensor causal_conv1d(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::Tensor& conv_state, const at::Tensor& qsl, const at::Tensor& slots, const at::Tensor& init,
                         bool silu) {
  const at::Tensor x = rows(x_in, 2, "causal_conv1d: x");
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 1, "causal_conv1d: weight ", weight.sizes(),
              " is not [C, K] for x ", x.sizes());
  const int64_t K = weight.size(1);
  State state(conv_state, 3, "causal_conv1d: conv_state");
  TORCH_CHECK(conv_state.size(1) == C && conv_state.size(2) == K - 1, "causal_conv1d: conv_state ", conv_state.sizes(),
              " is not [slots, ", C, ", ", K - 1, "]");
  const Requests r = requests(qsl, slots, init, T, conv_state.size(0), "causal_conv1d");
  const at::Tensor w32 = f32(weight);  // [C, K]
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == C, "causal_conv1d: bias has ", bias->numel(), " elements, not ", C);
    b32 = f32(*bias).reshape({C});
  }
  at::Tensor out = at::empty({T, C}, x.options());
  const float* wp = w32.const_data_ptr<float>();
  const float* bp = bias.has_value() ? b32.const_data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0);
  by_dtype(x, "causal_conv1d: x", [&](auto tag) {
    using E = decltype(tag);
    const E* xp = cptr<E>(x);
    E* op = mptr<E>(out);
    run_tasks(r, (C + CB - 1) / CB, C * K, (2 * K + 2) * CB, [&](const Task& task, float* s) {
      const int64_t a = r.start[task.req], L = r.len(task.req), slot = r.slot[task.req];
      const int64_t c0 = task.block * CB, n = std::min(CB, C - c0);
      float *ring = s, *w = ring + K * CB, *bl = w + K * CB, *y = bl + CB;
      std::fill(s, y, 0.f);
      for (int64_t c = 0; c < n; ++c)
        for (int64_t j = 0; j < K; ++j) w[j * CB + c] = wp[(c0 + c) * K + j];
      if (bp) std::memcpy(bl, bp + c0, n * sizeof(float));
      const int64_t o = state.off(slot, c0, 0);  // ring rows 0 .. K-2: the slot's K - 1 columns
      state.load(o, state.s[2], state.s[1], K - 1, n, ring, CB, r.init[task.req]);
      thread_local std::vector<int64_t> offs;
      offs.resize(K);
      for (int64_t t = 0; t < L; ++t) {
        float* newest = ring + ((t + K - 1) % K) * CB;
        const E* xr = xp + (a + t) * xs + c0;
        for (int64_t c = 0; c < n; ++c) newest[c] = ld(xr[c]);
        for (int64_t j = 0; j < K; ++j) offs[j] = ((t + j) % K) * CB;
        for (int64_t i = 0; i < CB; i += W) {
          vf acc = vload(bl + i);
          for (int64_t j = 0; j < K; ++j) acc += vload(w + j * CB + i) * vload(ring + offs[j] + i);
          vstore(y + i, silu ? vsilu(acc) : acc);
        }
        E* orow = op + (a + t) * C + c0;
        for (int64_t c = 0; c < n; ++c) st(orow + c, y[c]);
      }
      for (int64_t j = 0; j + 1 < K; ++j) state.save(o + j * state.s[2], 0, state.s[1], 1, n, ring + ((L + j) % K) * CB, CB);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Mamba-2 (SSD): a task is a request's head and block of PB = 4 W of its P state rows; per token:
// h = exp(dt A) h + (dt x_p) B; y_p = h . C + D x_p. A short run of tokens (a decode) updates the
// rows where they are (`Rows`: the slot itself when fp32), a longer one a transposed copy [N][PB]
// in L1 (vectors along P: no horizontal sums, B and C read as scalars).

constexpr int64_t ROW_TOKENS = 16;  // fewer tokens than this: the row layout (a transpose costs ~10 tokens)

// dt' = clamp(softplus(dt + dt_bias)) in fp32 by ATen, as the reference computes it
at::Tensor dt_prepared(const at::Tensor& dt, const std::optional<at::Tensor>& dt_bias, bool softplus, double lo, double hi) {
  at::Tensor d = dt.to(at::kFloat);
  if (dt_bias.has_value()) d = d.add(dt_bias->to(at::kFloat));
  if (softplus) d = at::softplus(d);
  if (!(lo == 0.0 && std::isinf(hi) && hi > 0)) d = at::clamp(d, lo, hi);
  return d.contiguous();
}

at::Tensor optional_f32(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return at::Tensor();
  TORCH_CHECK(t->numel() == n, what, " has ", t->numel(), " elements, not ", n);
  return f32(*t).reshape({n});
}

at::Tensor ssd_scan(const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& C, at::Tensor& ssm_state, const at::Tensor& qsl, const at::Tensor& slots,
                    const at::Tensor& init, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
                    bool dt_softplus, double dt_min, double dt_max) {
  const at::Tensor x = rows(x_in, 3, "ssd_scan: x");
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && B.sizes() == C.sizes() && B.size(0) == T && B.size(1) >= 1 && H % B.size(1) == 0,
              "ssd_scan: B ", B.sizes(), " and C ", C.sizes(), " must be [T, G, N] with G dividing the ", H, " heads");
  const int64_t G = B.size(1), N = B.size(2), Np = pad(N), rep = H / G;
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H && A.numel() == H, "ssd_scan: dt ", dt.sizes(), " / A ",
              A.sizes(), " do not fit x ", x.sizes());
  State state(ssm_state, 4, "ssd_scan: ssm_state");
  TORCH_CHECK(ssm_state.size(1) == H && ssm_state.size(2) == P && ssm_state.size(3) == N, "ssd_scan: ssm_state ",
              ssm_state.sizes(), " is not [slots, ", H, ", ", P, ", ", N, "]");
  const Requests r = requests(qsl, slots, init, T, ssm_state.size(0), "ssd_scan");
  const at::Tensor dts = dt_prepared(dt, dt_bias, dt_softplus, dt_min, dt_max), A32 = f32(A).reshape({H});
  const at::Tensor D32 = optional_f32(D, H, "ssd_scan: D"), B32 = padded(B, Np), C32 = padded(C, Np);
  const float *dtp = dts.const_data_ptr<float>(), *Ap = A32.const_data_ptr<float>(), *Bp = B32.const_data_ptr<float>(),
              *Cp = C32.const_data_ptr<float>(), *Dp = D.has_value() ? D32.const_data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({T, H, P}, x.options());
  const int64_t PB = 4 * W, blocks = (P + PB - 1) / PB;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  by_dtype(x, "ssd_scan: x", [&](auto tag) {
    using E = decltype(tag);
    const E* xp = cptr<E>(x);
    E* op = mptr<E>(out);
    run_tasks(r, H * blocks, H * P * N, std::max(PB * Np, N * PB) + 2 * PB, [&](const Task& task, float* s) {
      const int64_t a = r.start[task.req], b = r.start[task.req + 1], slot = r.slot[task.req];
      const int64_t h = task.block / blocks, p0 = task.block % blocks * PB, np = std::min(PB, P - p0), g = h / rep;
      const float Ah = Ap[h], Dh = Dp ? Dp[h] : 0.f;
      const int64_t o = state.off(slot, h, p0, 0);
      if (b - a < ROW_TOKENS) {  // rows of N, in place
        const Rows hs(state, o, state.s[2], state.s[3], np, N, Np, r.init[task.req], s);
        for (int64_t t = a; t < b; ++t) {
          const float dtv = dtp[t * H + h], dA = std::exp(dtv * Ah);
          const float *Bt = Bp + (t * G + g) * Np, *Ct = Cp + (t * G + g) * Np;
          const E* xr = xp + t * xs0 + h * xs1 + p0;
          E* yr = op + (t * H + h) * P + p0;
          for (int64_t p = 0; p < np; ++p) {
            const float xv = ld(xr[p]), dx = dtv * xv;
            float* hr = hs.p + p * hs.ld;
            vf acc0 = {}, acc1 = {};
            int64_t i = 0;
            for (; i + 2 * W <= Np; i += 2 * W) {
              const vf h0 = vload(hr + i) * dA + dx * vload(Bt + i), h1 = vload(hr + i + W) * dA + dx * vload(Bt + i + W);
              vstore(hr + i, h0);
              vstore(hr + i + W, h1);
              acc0 += h0 * vload(Ct + i);
              acc1 += h1 * vload(Ct + i + W);
            }
            if (i < Np) {
              const vf h0 = vload(hr + i) * dA + dx * vload(Bt + i);
              vstore(hr + i, h0);
              acc0 += h0 * vload(Ct + i);
            }
            st(yr + p, hsum(acc0 + acc1) + Dh * xv);
          }
        }
        hs.close();
        return;
      }
      float *hT = s, *xb = s + N * PB, *yb = xb + PB;  // hT [N][PB]: column p of the rows
      std::fill(s, yb + PB, 0.f);
      state.load(o, state.s[3], state.s[2], N, np, hT, PB, r.init[task.req]);
      for (int64_t t = a; t < b; ++t) {
        const float dtv = dtp[t * H + h], dA = std::exp(dtv * Ah);
        const float *Bt = Bp + (t * G + g) * Np, *Ct = Cp + (t * G + g) * Np;
        const E* xr = xp + t * xs0 + h * xs1 + p0;
        for (int64_t p = 0; p < np; ++p) xb[p] = ld(xr[p]);
        vf xv[4], dx[4], y[4];
        for (int v = 0; v < 4; ++v) {
          xv[v] = vload(xb + v * W);
          dx[v] = xv[v] * dtv;
          y[v] = vf{};
        }
        for (int64_t n = 0; n < N; ++n) {
          float* row = hT + n * PB;
          const float bn = Bt[n], cn = Ct[n];
          for (int v = 0; v < 4; ++v) {
            const vf hv = vload(row + v * W) * dA + dx[v] * bn;
            vstore(row + v * W, hv);
            y[v] += hv * cn;
          }
        }
        for (int v = 0; v < 4; ++v) vstore(yb + v * W, y[v] + xv[v] * Dh);
        E* yr = op + (t * H + h) * P + p0;
        for (int64_t p = 0; p < np; ++p) st(yr + p, yb[p]);
      }
      state.save(o, state.s[3], state.s[2], N, np, hT, PB);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Mamba-1: a task is a request's block of DB of its Dm state rows; per token and row d:
// h = exp(dt_d A_d) h + (dt_d x_d) B; y_d = (h . C + D_d x_d) silu(z_d).

constexpr int64_t DB = 64;

at::Tensor selective_scan(const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                          const at::Tensor& C, at::Tensor& ssm_state, const at::Tensor& qsl, const at::Tensor& slots,
                          const at::Tensor& init, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                          const std::optional<at::Tensor>& dt_bias, bool dt_softplus) {
  const at::Tensor x = rows(x_in, 2, "selective_scan: x");
  const int64_t T = x.size(0), Dm = x.size(1);
  TORCH_CHECK(A.dim() == 2 && A.size(0) == Dm, "selective_scan: A ", A.sizes(), " is not [", Dm, ", N]");
  const int64_t N = A.size(1), Np = pad(N);
  TORCH_CHECK(B.dim() == 2 && B.sizes() == C.sizes() && B.size(0) == T && B.size(1) == N, "selective_scan: B ", B.sizes(),
              " and C ", C.sizes(), " must be [", T, ", ", N, "]");
  TORCH_CHECK(dt.sizes() == x.sizes(), "selective_scan: dt ", dt.sizes(), " is not x's ", x.sizes());
  TORCH_CHECK(!z.has_value() || z->sizes() == x.sizes(), "selective_scan: z ", z.has_value() ? z->sizes() : x.sizes(),
              " is not x's ", x.sizes());
  State state(ssm_state, 3, "selective_scan: ssm_state");
  TORCH_CHECK(ssm_state.size(1) == Dm && ssm_state.size(2) == N, "selective_scan: ssm_state ", ssm_state.sizes(),
              " is not [slots, ", Dm, ", ", N, "]");
  const Requests r = requests(qsl, slots, init, T, ssm_state.size(0), "selective_scan");
  const at::Tensor dts = dt_prepared(dt, dt_bias, dt_softplus, 0.0, INFINITY), A32 = padded(A, Np);
  const at::Tensor D32 = optional_f32(D, Dm, "selective_scan: D"), B32 = padded(B, Np), C32 = padded(C, Np);
  const at::Tensor zs = z.has_value() ? at::silu(z->to(at::kFloat)).contiguous() : at::Tensor();
  const float *dtp = dts.const_data_ptr<float>(), *Ap = A32.const_data_ptr<float>(), *Bp = B32.const_data_ptr<float>(),
              *Cp = C32.const_data_ptr<float>(), *Dp = D.has_value() ? D32.const_data_ptr<float>() : nullptr,
              *zp = z.has_value() ? zs.const_data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({T, Dm}, x.options());
  const int64_t xs = x.stride(0);
  by_dtype(x, "selective_scan: x", [&](auto tag) {
    using E = decltype(tag);
    const E* xp = cptr<E>(x);
    E* op = mptr<E>(out);
    run_tasks(r, (Dm + DB - 1) / DB, Dm * N * 4, DB * Np, [&](const Task& task, float* s) {
      const int64_t a = r.start[task.req], b = r.start[task.req + 1], slot = r.slot[task.req];
      const int64_t d0 = task.block * DB, nd = std::min(DB, Dm - d0);
      const Rows hs(state, state.off(slot, d0, 0), state.s[1], state.s[2], nd, N, Np, r.init[task.req], s);
      for (int64_t t = a; t < b; ++t) {
        const float *Bt = Bp + t * Np, *Ct = Cp + t * Np;
        for (int64_t d = 0; d < nd; ++d) {
          const int64_t dd = d0 + d;
          const float dtv = dtp[t * Dm + dd], xv = ld(xp[t * xs + dd]), dx = dtv * xv;
          float* hr = hs.p + d * hs.ld;
          const float* Ad = Ap + dd * Np;
          vf acc = {};
          for (int64_t i = 0; i < Np; i += W) {
            const vf hv = vexp(vload(Ad + i) * dtv) * vload(hr + i) + dx * vload(Bt + i);
            vstore(hr + i, hv);
            acc += hv * vload(Ct + i);
          }
          float y = hsum(acc) + (Dp ? Dp[dd] * xv : 0.f);
          if (zp) y *= zp[t * Dm + dd];
          st(op + t * Dm + dd, y);
        }
      }
      hs.close();
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Gated delta rule: a task is a request's value head and block of VB = 2 W of its V state columns
// (K x VB floats, in L1); per token: S = exp(g) S; delta = beta (v - k S); S += k (outer) delta;
// o = q S. Token t's update and output share one pass over S with token t + 1's decay and k S.

constexpr int64_t VB = 2 * W;

template <typename E>
struct QK {  // token t's q and k of one key head: fp32, l2-normalised (when asked), q scaled
  const E *q, *k;
  int64_t qs0, qs1, ks0, ks1, K, Kp;
  float scale;
  bool norm;
  void operator()(int64_t t, int64_t head, float* qq, float* kk) const {
    const E *qr = q + t * qs0 + head * qs1, *kr = k + t * ks0 + head * ks1;
    for (int64_t i = 0; i < K; ++i) {
      qq[i] = ld(qr[i]);
      kk[i] = ld(kr[i]);
    }
    float qn = 1.f, kn = 1.f;
    if (norm) {
      vf sq = {}, sk = {};
      for (int64_t i = 0; i < Kp; i += W) {
        const vf a = vload(qq + i), b = vload(kk + i);
        sq += a * a;
        sk += b * b;
      }
      qn = 1.f / std::sqrt(hsum(sq) + 1e-6f);
      kn = 1.f / std::sqrt(hsum(sk) + 1e-6f);
    }
    for (int64_t i = 0; i < K; ++i) {
      qq[i] = qq[i] * qn * scale;
      kk[i] = kk[i] * kn;
    }
  }
};

at::Tensor gated_delta_rule(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& state_t, const at::Tensor& qsl, const at::Tensor& slots,
                            const at::Tensor& init, double scale, bool use_qk_l2norm) {
  const at::Tensor q = rows(q_in, 3, "gated_delta_rule: q"), k = rows(k_in, 3, "gated_delta_rule: k");
  const at::Tensor v = rows(v_in, 3, "gated_delta_rule: v");
  const int64_t T = v.size(0), Hv = v.size(1), V = v.size(2), Hk = q.size(1), K = q.size(2);
  TORCH_CHECK(q.sizes() == k.sizes() && q.size(0) == T && Hk >= 1 && Hv % Hk == 0, "gated_delta_rule: q ", q.sizes(), " / k ",
              k.sizes(), " must be [T, Hk, K] with Hk dividing v's ", Hv, " heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gated_delta_rule: q, k and v must share a dtype");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == T && g.size(1) == Hv && beta.sizes() == g.sizes(), "gated_delta_rule: g ",
              g.sizes(), " / beta ", beta.sizes(), " are not [", T, ", ", Hv, "]");
  State state(state_t, 4, "gated_delta_rule: state");
  TORCH_CHECK(state_t.size(1) == Hv && state_t.size(2) == K && state_t.size(3) == V, "gated_delta_rule: state ",
              state_t.sizes(), " is not [slots, ", Hv, ", ", K, ", ", V, "]");
  const Requests r = requests(qsl, slots, init, T, state_t.size(0), "gated_delta_rule");
  const at::Tensor g32 = f32(g), b32 = f32(beta);
  const float *gp = g32.const_data_ptr<float>(), *bp = b32.const_data_ptr<float>();
  at::Tensor out = at::empty({T, Hv, V}, v.options());
  const int64_t Kp = pad(K), blocks = (V + VB - 1) / VB, rep = Hv / Hk, vs0 = v.stride(0), vs1 = v.stride(1);
  by_dtype(v, "gated_delta_rule: q, k, v", [&](auto tag) {
    using E = decltype(tag);
    const QK<E> prep{cptr<E>(q), cptr<E>(k), q.stride(0), q.stride(1), k.stride(0), k.stride(1), K, Kp,
                     static_cast<float>(scale), use_qk_l2norm};
    const E* vp = cptr<E>(v);
    E* op = mptr<E>(out);
    run_tasks(r, Hv * blocks, Hv * K * V, K * VB + 4 * Kp + 2 * VB, [&](const Task& task, float* s) {
      const int64_t a = r.start[task.req], b = r.start[task.req + 1], slot = r.slot[task.req];
      const int64_t j = task.block / blocks, v0 = task.block % blocks * VB, nv = std::min(VB, V - v0), kh = j / rep;
      float *qq = s + K * VB, *kk = qq + Kp, *qn = kk + Kp, *kn = qn + Kp, *vv = kn + Kp, *o = vv + VB;
      std::fill(qq, o, 0.f);  // the padding of q, k and v rows stays zero
      const Rows Sr(state, state.off(slot, j, 0, v0), state.s[2], state.s[3], K, nv, VB, r.init[task.req], s);
      float* S = Sr.p;
      const int64_t ls = Sr.ld;
      if (a == b) return Sr.close();
      auto load_v = [&](int64_t t) {
        const E* vr = vp + t * vs0 + j * vs1 + v0;
        for (int64_t c = 0; c < nv; ++c) vv[c] = ld(vr[c]);
      };
      // token a: S = exp(g) S and k S
      prep(a, kh, qq, kk);
      load_v(a);
      float eg = std::exp(gp[a * Hv + j]);
      vf m0 = {}, m1 = {};
      for (int64_t i = 0; i < K; ++i) {
        const vf s0 = vload(S + i * ls) * eg, s1 = vload(S + i * ls + W) * eg;
        vstore(S + i * ls, s0);
        vstore(S + i * ls + W, s1);
        m0 += s0 * kk[i];
        m1 += s1 * kk[i];
      }
      for (int64_t t = a; t < b; ++t) {
        const float bt = bp[t * Hv + j];
        const vf d0 = (vload(vv) - m0) * bt, d1 = (vload(vv + W) - m1) * bt;
        vf o0 = {}, o1 = {};
        if (t + 1 < b) {  // token t's update and output, token t + 1's decay and k S
          prep(t + 1, kh, qn, kn);
          eg = std::exp(gp[(t + 1) * Hv + j]);
          m0 = vf{};
          m1 = vf{};
          for (int64_t i = 0; i < K; ++i) {
            vf s0 = vload(S + i * ls) + kk[i] * d0, s1 = vload(S + i * ls + W) + kk[i] * d1;
            o0 += s0 * qq[i];
            o1 += s1 * qq[i];
            s0 = s0 * eg;
            s1 = s1 * eg;
            vstore(S + i * ls, s0);
            vstore(S + i * ls + W, s1);
            m0 += s0 * kn[i];
            m1 += s1 * kn[i];
          }
        } else {
          for (int64_t i = 0; i < K; ++i) {
            const vf s0 = vload(S + i * ls) + kk[i] * d0, s1 = vload(S + i * ls + W) + kk[i] * d1;
            o0 += s0 * qq[i];
            o1 += s1 * qq[i];
            vstore(S + i * ls, s0);
            vstore(S + i * ls + W, s1);
          }
        }
        vstore(o, o0);
        vstore(o + W, o1);
        E* orow = op + (t * Hv + j) * V + v0;
        for (int64_t c = 0; c < nv; ++c) st(orow + c, o[c]);
        if (t + 1 < b) {
          std::swap(qq, qn);
          std::swap(kk, kn);
          load_v(t + 1);
        }
      }
      Sr.close();
    });
  });
  return out;
}

int64_t recurrent_vector_width() { return W; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start_loc, "
        "Tensor state_slots, Tensor has_initial_state, bool silu) -> Tensor");
  m.def("ssd_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor(a!) ssm_state, Tensor query_start_loc, "
        "Tensor state_slots, Tensor has_initial_state, Tensor? D, Tensor? dt_bias, bool dt_softplus, float dt_min, "
        "float dt_max) -> Tensor");
  m.def("selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor(a!) ssm_state, Tensor query_start_loc, "
        "Tensor state_slots, Tensor has_initial_state, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor");
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor query_start_loc, "
        "Tensor state_slots, Tensor has_initial_state, float scale, bool use_qk_l2norm) -> Tensor");
  m.def("recurrent_vector_width() -> int", &recurrent_vector_width);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) {
  m.impl("causal_conv1d", &causal_conv1d);
  m.impl("ssd_scan", &ssd_scan);
  m.impl("selective_scan", &selective_scan);
  m.impl("gated_delta_rule", &gated_delta_rule);
}
