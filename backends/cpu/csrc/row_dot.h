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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#if !defined(__AVX512F__)
#define PORTSIDE_ROWS_AVX2 1
#endif
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

// bf16 rows: x (fp32) . w_r (bf16 bits), accumulated in fp32. Each 8 weights are widened to 32
// bits and shifted into the high half (exactly their fp32 values), then one FMA; four
// accumulators. Without AVX2 and FMA, a scalar loop. (The fused step's and linear_row's.)
inline float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
// AVX-512: 32 weights per 64-byte load, widened without a shuffle: the odd ones are already the
// high halves of their 32-bit lanes (masked), the even ones shifted up; x's 32 values are split
// into their even and odd lanes in registers to match (two permutes, shared by dot2's rows). Each
// row's stream is prefetched 1 KiB ahead. Measured on a Sapphire Rapids VM (2 threads, the
// default model's 269 MB of bf16 matrices, one batch-1 pass): 10.5 ms against 14.8 ms with the
// AVX2 widening below and 9.4 ms for a plain sum of the same bytes.
constexpr int kPrefetchAhead = 1024;

struct EvenOdd {
  __m512 even, odd;
};

inline EvenOdd split_x(const float* x) {  // x[0..32) -> (x[0], x[2], ..), (x[1], x[3], ..)
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  return {_mm512_permutex2var_ps(x0, ie, x1), _mm512_permutex2var_ps(x0, io, x1)};
}

inline __m512 even_ps(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 odd_ps(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }

inline float dot1_bf16(const float* x, const uint16_t* r, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch((const char*)(r + k) + kPrefetchAhead, _MM_HINT_T0);
    const EvenOdd xs = split_x(x + k);
    const __m512i w = _mm512_loadu_si512(r + k);
    a0 = _mm512_fmadd_ps(xs.even, even_ps(w), a0);
    a1 = _mm512_fmadd_ps(xs.odd, odd_ps(w), a1);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; k < K; ++k) s += x[k] * bf16_value(r[k]);
  return s;
}

inline void dot2_bf16(const float* x, const uint16_t* r0, const uint16_t* r1, int64_t K, float* y0, float* y1) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch((const char*)(r0 + k) + kPrefetchAhead, _MM_HINT_T0);
    _mm_prefetch((const char*)(r1 + k) + kPrefetchAhead, _MM_HINT_T0);
    const EvenOdd xs = split_x(x + k);
    const __m512i w0 = _mm512_loadu_si512(r0 + k), w1 = _mm512_loadu_si512(r1 + k);
    a0 = _mm512_fmadd_ps(xs.even, even_ps(w0), a0);
    a1 = _mm512_fmadd_ps(xs.odd, odd_ps(w0), a1);
    b0 = _mm512_fmadd_ps(xs.even, even_ps(w1), b0);
    b1 = _mm512_fmadd_ps(xs.odd, odd_ps(w1), b1);
  }
  float s0 = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), s1 = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
  for (; k < K; ++k) {
    s0 += x[k] * bf16_value(r0[k]);
    s1 += x[k] * bf16_value(r1[k]);
  }
  *y0 = s0;
  *y1 = s1;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8_ps(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline float hsum_ps(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#if !defined(__AVX512F__)
inline float dot1_bf16(const float* x, const uint16_t* r, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16x8_ps(r + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), bf16x8_ps(r + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), bf16x8_ps(r + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), bf16x8_ps(r + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16x8_ps(r + k), a0);
  float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += x[k] * bf16_value(r[k]);
  return s;
}

inline void dot2_bf16(const float* x, const uint16_t* r0, const uint16_t* r1, int64_t K, float* y0, float* y1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(x0, bf16x8_ps(r0 + k), a0);
    a1 = _mm256_fmadd_ps(x1, bf16x8_ps(r0 + k + 8), a1);
    b0 = _mm256_fmadd_ps(x0, bf16x8_ps(r1 + k), b0);
    b1 = _mm256_fmadd_ps(x1, bf16x8_ps(r1 + k + 8), b1);
  }
  float s0 = hsum_ps(_mm256_add_ps(a0, a1)), s1 = hsum_ps(_mm256_add_ps(b0, b1));
  for (; k < K; ++k) {
    s0 += x[k] * bf16_value(r0[k]);
    s1 += x[k] * bf16_value(r1[k]);
  }
  *y0 = s0;
  *y1 = s1;
}
#endif  // !__AVX512F__
#else
inline float dot1_bf16(const float* x, const uint16_t* r, int64_t K) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * bf16_value(r[k]);
  return s;
}

inline void dot2_bf16(const float* x, const uint16_t* r0, const uint16_t* r1, int64_t K, float* y0, float* y1) {
  *y0 = dot1_bf16(x, r0, K);
  *y1 = dot1_bf16(x, r1, K);
}
#endif

// y[n] = x . w[n] for bf16 rows n in [n0, n1), the range's halves side by side as for fp32
// (linear_row's bf16 weights, and the fused step's: there, on the Sapphire Rapids VM, paired runs of
// the engine's batch-1 decode gave 10.3-10.8 ms/token against 11.1-11.3 one row after another and
// 11.1-11.7 with adjacent rows paired).
inline void rows(const float* x, const uint16_t* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t half = (n1 - n0) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = n0 + i, b = n0 + half + i;
    dot2_bf16(x, w + a * K, w + b * K, K, y + a, y + b);
  }
  if ((n1 - n0) % 2) y[n1 - 1] = dot1_bf16(x, w + (n1 - 1) * K, K);
}

}  // namespace portside_rows
