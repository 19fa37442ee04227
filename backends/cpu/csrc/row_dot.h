// Dot products of one fp32 row with the rows of a matrix, shared by the one-row linear
// (linear_row.cpp) and the fused decode step (fused_decode.cpp). Header-only, inline.
//
// `rows` (linear_row's) gives a thread one contiguous range of output rows and walks its two
// halves side by side (two streams in flight, each with its own accumulators): measured on the CI
// machine's Zen 4 over the default model's 121 weights in huge pages, 2 threads, 49.3 GB/s where
// one row at a time gets 42.1, Inductor's fused reduction ~33, and a plain sum of the same
// matrices 53.4. The fused step calls `dot1` / `dot2` itself: there one stream per thread was
// faster (fused_decode.cpp, `rows1`).

#pragma once

#include <cstdint>
#include <cstring>

namespace portside_rows {

typedef float v16f __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Dot products of x with rows r0 and r1 of w (K columns), into y0 and y1.
inline void dot2(const float* x, const float* r0, const float* r1, int64_t K, float* y0, float* y1) {
  v16f a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const v16f x0 = load16(x + k), x1 = load16(x + k + 16);
    a0 += x0 * load16(r0 + k);
    a1 += x1 * load16(r0 + k + 16);
    b0 += x0 * load16(r1 + k);
    b1 += x1 * load16(r1 + k + 16);
  }
  float s0 = hsum(a0 + a1), s1 = hsum(b0 + b1);
  for (; k < K; ++k) {
    s0 += x[k] * r0[k];
    s1 += x[k] * r1[k];
  }
  *y0 = s0;
  *y1 = s1;
}

inline float dot1(const float* x, const float* r, int64_t K) {
  v16f a0 = {0}, a1 = {0};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 += load16(x + k) * load16(r + k);
    a1 += load16(x + k + 16) * load16(r + k + 16);
  }
  float s = hsum(a0 + a1);
  for (; k < K; ++k) s += x[k] * r[k];
  return s;
}

// y[n] = x . w[n] for n in [n0, n1): rows n0 + i and n0 + half + i together.
inline void rows(const float* x, const float* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t half = (n1 - n0) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = n0 + i, b = n0 + half + i;
    dot2(x, w + a * K, w + b * K, K, y + a, y + b);
  }
  if ((n1 - n0) % 2) y[n1 - 1] = dot1(x, w + (n1 - 1) * K, K);
}

}  // namespace portside_rows
