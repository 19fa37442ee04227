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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PORTSIDE_ROWS_AVX2 1
#endif

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

#ifdef PORTSIDE_ROWS_AVX2
// Without AVX-512 a 16-float vector is two ymm registers, and GCC kept the accumulators below in
// memory, storing and reloading them in 8-byte pieces every iteration: measured on a Zen 3 (AVX2)
// over 400 MB of fp32 rows of 1536, `dot1` read 8.0 GB/s where the same sums in registers read
// 18 GB/s. So here each v16f accumulator is spelled as its two halves in __m256 registers, with
// the same FMAs and the same final order of additions: the results are the same bits.
struct v16 {
  __m256 lo, hi;
};

inline v16 fma16(const float* x, const float* w, v16 a) {
  return {_mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(w), a.lo),
          _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(w + 8), a.hi)};
}

inline float hsum(v16 a, v16 b) {  // hsum(a + b) of the vector version, lane by lane
  float t[16];
  _mm256_storeu_ps(t, _mm256_add_ps(a.lo, b.lo));
  _mm256_storeu_ps(t + 8, _mm256_add_ps(a.hi, b.hi));
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
}

inline void dot2(const float* x, const float* r0, const float* r1, int64_t K, float* y0, float* y1) {
  const v16 z = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  v16 a0 = z, a1 = z, b0 = z, b1 = z;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = fma16(x + k, r0 + k, a0);
    a1 = fma16(x + k + 16, r0 + k + 16, a1);
    b0 = fma16(x + k, r1 + k, b0);
    b1 = fma16(x + k + 16, r1 + k + 16, b1);
  }
  float s0 = hsum(a0, a1), s1 = hsum(b0, b1);
  for (; k < K; ++k) {
    s0 += x[k] * r0[k];
    s1 += x[k] * r1[k];
  }
  *y0 = s0;
  *y1 = s1;
}

inline float dot1(const float* x, const float* r, int64_t K) {
  const v16 z = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  v16 a0 = z, a1 = z;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = fma16(x + k, r + k, a0);
    a1 = fma16(x + k + 16, r + k + 16, a1);
  }
  float s = hsum(a0, a1);
  for (; k < K; ++k) s += x[k] * r[k];
  return s;
}
#else
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
#endif

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
