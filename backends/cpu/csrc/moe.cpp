// Mixture-of-experts in fp32 as a torch operator, for the cpu backend's ModelOps (moe.py):
// portside_cpu_native::moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights,
// Tensor topk_ids, str activation="silu") -> Tensor. Shapes as portside.ops.moe:
//   x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights [T, k] fp32,
//   topk_ids [T, k] int64 -> [T, H] fp32.
//
// The (token, slot) pairs are sorted by expert (a counting sort) and their rows of x gathered in
// that order, so each expert that received n tokens multiplies one contiguous [n, H] block; no
// work for an expert no token chose. An expert with more than DENSE_ROWS tokens (a long prefill)
// is two at::linear calls (a GEMM, compute-bound there). The others, in one OpenMP region:
//   A. per (expert, range of its I gate/up row pairs): h = act(x . gate_c) * (x . up_c), all n rows
//      of the expert at once (`rows_times`: each weight row is read once for up to 4 token rows);
//   B. per (expert, range of its H down rows): y = h . down_r;
//   C. per token: out[t] = sum over its slots of weight * y.
// Such a skinny matmul (a few tokens per expert: a decode batch) is bound by reading the
// expert's weights, which at::linear (MKL's sgemm, on AMD CPUs its AVX2 path) reads at a fraction
// of the bandwidth: 2-5x slower up to 16 tokens per expert here, faster from ~64 (docs/cpu.md).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// out[j][0..1] = x_j . w0, x_j . w1 for the R <= 4 rows x_j = x + j * K (K floats each).
template <int R>
inline void dots(const float* x, int64_t K, const float* w0, const float* w1, float out[][2]) {
  v8f a[R][2] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const v8f u = load8(w0 + k), v = load8(w1 + k);
    for (int j = 0; j < R; ++j) {
      const v8f xv = load8(x + j * K + k);
      a[j][0] += xv * u;
      a[j][1] += xv * v;
    }
  }
  for (int j = 0; j < R; ++j) {
    float s0 = hsum8(a[j][0]), s1 = hsum8(a[j][1]);
    for (int64_t kk = k; kk < K; ++kk) {
      s0 += x[j * K + kk] * w0[kk];
      s1 += x[j * K + kk] * w1[kk];
    }
    out[j][0] = s0;
    out[j][1] = s1;
  }
}

// For each of the n rows x_j (K floats, dense): f(j, x_j . w0, x_j . w1), 4 rows at a time, so
// the two weight rows come from memory once and from L1 for the next rows.
template <typename F>
inline void rows_times(const float* x, int64_t n, int64_t K, const float* w0, const float* w1, F f) {
  float d[4][2];
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    dots<4>(x + j * K, K, w0, w1, d);
    for (int i = 0; i < 4; ++i) f(j + i, d[i][0], d[i][1]);
  }
  const int64_t left = n - j;
  if (left == 3) dots<3>(x + j * K, K, w0, w1, d);
  if (left == 2) dots<2>(x + j * K, K, w0, w1, d);
  if (left == 1) dots<1>(x + j * K, K, w0, w1, d);
  for (int i = 0; i < left; ++i) f(j + i, d[i][0], d[i][1]);
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

inline float gelu_tanh(float g) {
  return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

struct Task {
  int64_t expert, r0, r1;  // rows [r0, r1) of the expert's matrix in this phase
};

constexpr int64_t CHUNK = 32;       // weight rows (gate/up pairs in phase A) per task
constexpr int64_t DENSE_ROWS = 16;  // an expert with more tokens than this runs at::linear

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                       const at::Tensor& topk_ids, c10::string_view activation) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "moe_experts: activation ", activation,
              " is not one of silu, gelu_tanh");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && w13.scalar_type() == at::kFloat &&
                  w2.scalar_type() == at::kFloat && w13.dim() == 3 && w2.dim() == 3,
              "moe_experts: needs fp32 cpu x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "moe_experts: w13 ", w13.sizes(), " / w2 ", w2.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_weights / topk_ids must be [T, k], the ids int64");
  const int64_t k = topk_ids.size(1), P = T * k;
  const at::Tensor xc = x.contiguous(), a = w13.contiguous(), b = w2.contiguous();
  const at::Tensor ids_t = topk_ids.contiguous(), wts_t = topk_weights.to(at::kFloat).contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* wts = wts_t.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "moe_experts: expert id ", ids[p], " outside [0, ", E, ")");

  // counting sort of the pairs by expert: pos[p] is pair p's row in the sorted order
  std::vector<int64_t> start(E + 1, 0), pos(P);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) pos[p] = next[ids[p]]++;

  at::Tensor xs = at::empty({P, H}, x.options()), hs = at::empty({P, I}, x.options());
  at::Tensor ys = at::empty({P, H}, x.options()), out = at::empty({T, H}, x.options());
  const float *xp = xc.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float *xsp = xs.data_ptr<float>(), *hp = hs.data_ptr<float>(), *yp = ys.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(xsp + pos[p] * H, xp + (p / k) * H, H * sizeof(float));
  });
  const bool use_silu = activation == "silu";
  std::vector<Task> tasks_a, tasks_b;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = start[e], n = start[e + 1] - s;
    if (n > DENSE_ROWS) {
      const at::Tensor gate_up = at::linear(xs.narrow(0, s, n), a[e]);  // [n, 2I]
      const at::Tensor gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
      const at::Tensor act = use_silu ? at::silu(gate) : at::gelu(gate, "tanh");
      ys.narrow(0, s, n).copy_(at::linear(act.mul(up), b[e]));
    } else if (n) {
      for (int64_t r = 0; r < I; r += CHUNK) tasks_a.push_back({e, r, std::min(I, r + CHUNK)});
      for (int64_t r = 0; r < H; r += 2 * CHUNK) tasks_b.push_back({e, r, std::min(H, r + 2 * CHUNK)});
    }
  }
  const int threads = std::max(1, at::get_num_threads());

#pragma omp parallel num_threads(threads) if (threads > 1 && P * H * I > (1 << 16))
  {
    // A: h[:, c] = act(x . gate_c) * (x . up_c)
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < tasks_a.size(); ++t) {
      const Task& task = tasks_a[t];
      const int64_t s = start[task.expert], n = start[task.expert + 1] - s;
      const float* w = ap + task.expert * 2 * I * H;
      for (int64_t c = task.r0; c < task.r1; ++c)
        rows_times(xsp + s * H, n, H, w + c * H, w + (I + c) * H, [&](int64_t j, float g, float u) {
          hp[(s + j) * I + c] = (use_silu ? silu(g) : gelu_tanh(g)) * u;
        });
    }
    // B: y[:, r] = h . down_r (rows in pairs)
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < tasks_b.size(); ++t) {
      const Task& task = tasks_b[t];
      const int64_t s = start[task.expert], n = start[task.expert + 1] - s;
      const float* w = bp + task.expert * H * I;
      int64_t r = task.r0;
      for (; r + 2 <= task.r1; r += 2)
        rows_times(hp + s * I, n, I, w + r * I, w + (r + 1) * I, [&](int64_t j, float y0, float y1) {
          yp[(s + j) * H + r] = y0;
          yp[(s + j) * H + r + 1] = y1;
        });
      if (r < task.r1)
        rows_times(hp + s * I, n, I, w + r * I, w + r * I, [&](int64_t j, float y0, float) { yp[(s + j) * H + r] = y0; });
    }
    // C: each token's weighted sum over its slots
#pragma omp for schedule(static)
    for (int64_t tok = 0; tok < T; ++tok) {
      float* o = op + tok * H;
      std::memset(o, 0, H * sizeof(float));
      for (int64_t slot = 0; slot < k; ++slot) {
        const float wt = wts[tok * k + slot], *y = yp + pos[tok * k + slot] * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] += wt * y[h];
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation='silu') -> Tensor");
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("moe_experts", &moe_experts); }
