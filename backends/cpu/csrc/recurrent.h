// The helpers of recurrent.cpp (the cpu backend's recurrent-layer kernels): vectors of fp32 lanes
// (GCC vector extensions, 16 lanes with AVX-512, else 8) with an exp, bf16 loads and stores, a
// state slot tensor read and written at any strides, the step's requests, and the OpenMP task
// loop every kernel runs.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace portside_recurrent {

#if defined(__AVX512F__)
#define PS_RECURRENT_W 16
#else
#define PS_RECURRENT_W 8
#endif
constexpr int W = PS_RECURRENT_W;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float s) { return vf{} + s; }

inline float hsum(vf v) {
#if PS_RECURRENT_W == 16
  const v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8 h = v;
#endif
  v4 a = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1);
  a += __builtin_shufflevector(a, a, 1, 0, 3, 2);
  return a[0];
}

// exp on a vector (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2], ~1 ulp),
// the argument clamped to [ln(FLT_MIN), 88] (the kernels' arguments are <= 0 or a silu's).
inline vf vexp(vf x) {
  const vf hi = splat(88.f), lo = splat(-87.33654475f), magic = splat(12582912.f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vf n = (x * 1.44269504088896341f + magic) - magic;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * (vf)e;
}
inline vf vsilu(vf x) { return x / (1.f + vexp(-x)); }

// element loads and stores: fp32, or bf16 as its bits (rounded to nearest even)
inline float ld(float v) { return v; }
inline float ld(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = v != v ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename F>
void by_dtype(const at::Tensor& t, const char* what, F f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, " must be fp32 or bf16, got ", t.scalar_type());
    f(uint16_t{});
  }
}

template <typename T>
const T* cptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }
template <typename T>
T* mptr(at::Tensor& t) { return reinterpret_cast<T*>(t.mutable_data_ptr()); }

// A big input read in place: any strides but a unit last one (else a contiguous copy).
inline at::Tensor rows(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.dim() == dim && t.device().is_cpu(), what, " must be a ", dim, "-d cpu tensor, got ", t.sizes());
  return t.stride(dim - 1) == 1 ? t : t.contiguous();
}
inline at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }
inline int64_t pad(int64_t n) { return (n + W - 1) / W * W; }

// fp32 copy of t [..., N] with its last dimension zero-padded to Np
inline at::Tensor padded(const at::Tensor& t, int64_t Np) {
  const int64_t N = t.size(-1);
  if (N == Np && t.scalar_type() == at::kFloat) return t.contiguous();
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes.back() = Np;
  at::Tensor out = N == Np ? at::empty(sizes, t.options().dtype(at::kFloat)) : at::zeros(sizes, t.options().dtype(at::kFloat));
  out.narrow(-1, 0, N).copy_(t);
  return out;
}

// A state tensor [S, d1, d2(, d3)], fp32 or bf16, any strides, read and written as fp32.
struct State {
  char* base;
  bool bf16;
  std::vector<int64_t> s;  // strides, in elements
  State(at::Tensor& t, int64_t dim, const char* what) {
    TORCH_CHECK(t.dim() == dim && t.device().is_cpu(), what, " must be a ", dim, "-d cpu tensor, got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, " must be fp32 or bf16, got ",
                t.scalar_type());
    base = static_cast<char*>(t.mutable_data_ptr());
    bf16 = t.scalar_type() == at::kBFloat16;
    s = t.strides().vec();
  }
  int64_t off(int64_t slot, int64_t i, int64_t j, int64_t k = 0) const {
    return slot * s[0] + i * s[1] + j * s[2] + (s.size() > 3 ? k * s[3] : 0);
  }
  // nr rows of n elements, element (i, c) at o + i * rs + c * cs, to dst + i * ldd + c (zeros when !init)
  void load(int64_t o, int64_t rs, int64_t cs, int64_t nr, int64_t n, float* dst, int64_t ldd, bool init) const {
    if (bf16) copy_rows(reinterpret_cast<const uint16_t*>(base) + o, rs, cs, dst, ldd, 1, nr, n, init);
    else copy_rows(reinterpret_cast<const float*>(base) + o, rs, cs, dst, ldd, 1, nr, n, init);
  }
  // the inverse: src + i * lds + c to element (i, c)
  void save(int64_t o, int64_t rs, int64_t cs, int64_t nr, int64_t n, const float* src, int64_t lds) const {
    if (bf16) copy_rows(src, lds, 1, reinterpret_cast<uint16_t*>(base) + o, rs, cs, nr, n, true);
    else copy_rows(src, lds, 1, reinterpret_cast<float*>(base) + o, rs, cs, nr, n, true);
  }
  template <typename S, typename D>
  static void copy_rows(const S* src, int64_t rs, int64_t cs, D* dst, int64_t rd, int64_t cd, int64_t nr, int64_t n,
                        bool init) {
    for (int64_t i = 0; i < nr; ++i) {
      const S* s = src + i * rs;
      D* d = dst + i * rd;
      if (!init) for (int64_t c = 0; c < n; ++c) st(d + c * cd, 0.f);
      else if (cs == 1 && cd == 1) for (int64_t c = 0; c < n; ++c) st(d + c, ld(s[c]));
      else for (int64_t c = 0; c < n; ++c) st(d + c * cd, ld(s[c * cs]));
    }
  }
};

// A block of nr state rows of n elements (element (i, c) at o + i * rs + c * cs) a kernel updates
// as fp32 rows of `width` floats (whole vectors, >= n) at `p`, `ld` apart: the state itself when
// it is fp32, cs is 1 and n is `width` (rows zeroed when !init), else a copy in `scratch` padded
// with zeros, written back by `close`.
struct Rows {
  const State& st;
  int64_t o, rs, cs, nr, n, ld;
  bool copy;
  float* p;
  Rows(const State& s, int64_t o_, int64_t rs_, int64_t cs_, int64_t nr_, int64_t n_, int64_t width, bool init,
       float* scratch)
      : st(s), o(o_), rs(rs_), cs(cs_), nr(nr_), n(n_) {
    copy = s.bf16 || cs != 1 || n != width;
    ld = copy ? width : rs;
    p = copy ? scratch : reinterpret_cast<float*>(s.base) + o;
    if (copy) std::fill(scratch, scratch + nr * ld, 0.f);
    if (init ? copy : !copy) s.load(o, rs, cs, nr, n, p, ld, init);  // a copy of the state, or zeros in place
  }
  void close() const {
    if (copy) st.save(o, rs, cs, nr, n, p, ld);
  }
};

// The step's requests: token ranges, slots, whether each starts from its slot.
struct Requests {
  std::vector<int64_t> start, slot;
  std::vector<bool> init;
  int64_t size() const { return static_cast<int64_t>(slot.size()); }
  int64_t len(int64_t i) const { return start[i + 1] - start[i]; }
};

inline Requests requests(const at::Tensor& qsl, const at::Tensor& slots, const at::Tensor& init, int64_t T, int64_t num_slots,
                  const char* op) {
  TORCH_CHECK(qsl.dim() == 1 && qsl.numel() >= 1 && slots.dim() == 1 && init.dim() == 1 &&
                  slots.numel() == qsl.numel() - 1 && init.numel() == slots.numel(),
              op, ": query_start_loc [R + 1], state_slots [R] and has_initial_state [R] do not agree: ", qsl.sizes(), ", ",
              slots.sizes(), ", ", init.sizes());
  const at::Tensor q = qsl.to(at::kLong).contiguous(), s = slots.to(at::kLong).contiguous(), b = init.to(at::kBool).contiguous();
  Requests r;
  r.start.assign(q.const_data_ptr<int64_t>(), q.const_data_ptr<int64_t>() + q.numel());
  r.slot.assign(s.const_data_ptr<int64_t>(), s.const_data_ptr<int64_t>() + s.numel());
  for (int64_t i = 0; i < b.numel(); ++i) r.init.push_back(b.const_data_ptr<bool>()[i]);
  TORCH_CHECK(r.start[0] >= 0 && r.start.back() <= T, op, ": query_start_loc spans [", r.start[0], ", ", r.start.back(),
              ") outside the ", T, " tokens");
  for (int64_t i = 0; i < r.size(); ++i) {
    TORCH_CHECK(r.start[i + 1] >= r.start[i], op, ": query_start_loc decreases at request ", i);
    TORCH_CHECK(r.slot[i] >= 0 && r.slot[i] < num_slots, op, ": request ", i, "'s state slot ", r.slot[i], " outside [0, ",
                num_slots, ")");
  }
  return r;
}

struct Task {
  int64_t req, block, cost;
};

// Run f(task, scratch) for every (request, block) pair, longest requests first, over OpenMP
// threads (one when the work is small); scratch: `scratch_floats` per thread.
template <typename F>
void run_tasks(const Requests& r, int64_t blocks, int64_t work_per_token, int64_t scratch_floats, F f) {
  std::vector<Task> tasks;
  int64_t total = 0;
  for (int64_t i = 0; i < r.size(); ++i) {
    total += r.len(i);  // (a request without tokens still leaves its slot: zeros, or as it was)
    for (int64_t b = 0; b < blocks; ++b) tasks.push_back({i, b, r.len(i)});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int threads = std::max(1, at::get_num_threads());
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1 && total * work_per_token > (1 << 16))
  {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats) + W, 0.f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; ++t) f(tasks[t], scratch.data());
  }
}

}  // namespace portside_recurrent
