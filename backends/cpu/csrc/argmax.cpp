// Row-wise argmax of fp32 logits as a torch operator, for the sampler's greedy rows and its
// exponential race: portside_cpu_native::argmax_rows(Tensor x) -> Tensor ([N, V] -> [N] int64).
//
// Same result as torch.argmax(x, dim=-1): the first index of the row's largest value, and the
// first NaN's index when the row has one (torch ranks NaN above every number). torch 2.x's CPU
// argmax walks each row one element at a time (~43 us for one 49152-token row here, 1.3 ms for
// 64 rows); this takes two vectorized passes over the row, the max and then its first index, the
// row staying in L2 between them (8 us with the call from Python; 64 rows 0.41 ms, reading the
// logits at ~31 GB/s). Anything else (another dtype, a non-dense row, other ranks) goes to
// at::argmax, so it is always correct to call.

#include <ATen/Parallel.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  // Pass 1: the max, and whether any NaN occurs (x != x).
  const float lowest = -std::numeric_limits<float>::infinity();
  v16f m = {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest,
            lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  v16i nan = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f v = load16(x + i);
    nan |= v != v;
    m = v > m ? v : m;
  }
  float best = lowest;
  for (int k = 0; k < 16; ++k) best = m[k] > best ? m[k] : best;
  bool any_nan = false;
  for (int k = 0; k < 16; ++k) any_nan |= nan[k] != 0;
  for (int64_t j = i; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    best = x[j] > best ? x[j] : best;
  }
  if (any_nan) return first_nan(x, n);
  // Pass 2: the first index holding it (-inf rows: index 0, as torch).
  i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16i hit = load16(x + i) == best;
    bool any = false;
    for (int k = 0; k < 16; ++k) any |= hit[k] != 0;
    if (any)
      for (int k = 0; k < 16; ++k)
        if (hit[k]) return i + k;
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || x.dim() != 2 || x.stride(1) != 1 || x.size(1) == 0)
    return at::argmax(x, -1);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
