// Dot products of a few fp32 input rows (M = 1..16) with rows of a matrix (fp32 or bf16 bits),
// each weight loaded once for all M inputs: the fused step's multi-row path (fused_decode.cpp,
// `step_rows` and `logits`: a speculative verification, a short prefill chunk). Header-only.
//
// `dots<NR>(x, M, w[NR], K, y[NR], ys, next)`: y[j][m * ys] = x_m . w[j] for the M rows
// x_m = x + m * K (`next`: where the next tile's rows are, w[j] + next, to prefetch; 0: none).
// The inputs are cut into balanced groups of at most kGroup rows; each group is one register tile
// of NR weight rows x its rows of accumulators, so one load of weights feeds that many FMAs; the
// groups after the first read the weight rows again from L1.
//
// AVX-512 (Zen 4/5, Ice Lake+): 16 floats a vector, tiles of 4 weight rows x up to 6 inputs (24
// accumulators, 4 weight vectors and one input vector in 32 registers), the next tile's 4 weight
// rows prefetched as this one is read. Each weight and input vector is loaded once into a register
// (an empty asm pins it there): GCC otherwise folded the loads into the FMAs, 28 512-bit loads for
// 24 FMAs, and L1's 512-bit loads, not the FMAs, set the pace (in L2, 4 x 6 tile: 53 -> 114 G
// multiply-adds/s on one Zen 5 core; its FMA peak is ~133). Measured on a Zen 5 (2 threads, a
// 12-layer 1024-wide fp32 model, 200-token context, `step_rows` against the batch-1 `step` in one
// process): with the AVX2 tile below 2 rows 1.65x, 4 rows 2.19x, 6 rows 3.01x, 8 rows 3.71x; with
// this one 1.22x, 1.34x, 1.39x, 1.59x (memory in its slower state, the batch-1 step 11.4 ms), and
// in the faster state (7.8 ms; that run without the prefetch) 1.55x, 1.85x, 2.08x, 2.54x: one
// core streams its rows at ~21 GB/s with a 6-row tile against ~31 GB/s for one row, the tile's
// arithmetic not hidden behind the stream (software prefetch 1-3 tiles ahead, to L1 or L2, and
// padded input rows changed nothing).
// Elsewhere (AVX2 + FMA): 8 floats a vector, tiles of 2 weight rows x up to 6 inputs (14 of the
// 16 registers); NR = 4 is two NR = 2 tiles. Without FMA, GCC's vector extension.

#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "row_dot.h"

namespace portside_tile {

using portside_rows::bf16_value;
inline float wvalue(float w) { return w; }
inline float wvalue(uint16_t w) { return bf16_value(w); }

constexpr int kGroup = 6;  // input rows per register tile

#if defined(__AVX512F__)
inline __m512 loadw16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 loadw16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact: the high halves)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int NR, int MR, class W>
inline void tile(const float* x, int64_t xs, const W* const* w, int64_t K, float* const* y, int64_t ys, int64_t next) {
  __m512 acc[NR][MR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if (next) _mm_prefetch((const char*)(w[j] + next + k), _MM_HINT_T0);
      wv[j] = loadw16(w[j] + k);
      __asm__("" : "+v"(wv[j]));  // in a register: GCC would fold the load into each FMA (MR loads)
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512 xm = _mm512_loadu_ps(x + m * xs + k);
      __asm__("" : "+v"(xm));  // likewise: one load for NR FMAs
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[j][m] = _mm512_fmadd_ps(xm, wv[j], acc[j][m]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      float s = _mm512_reduce_add_ps(acc[j][m]);
      for (int64_t i = k; i < K; ++i) s += x[m * xs + i] * wvalue(w[j][i]);  // K not a multiple of 16
      y[j][m * ys] = s;
    }
}
#else
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc + x * w as one FMA. Spelled out: under -std=c++20 (ISO mode) GCC does not contract a
// multiply and an add into an FMA, which would halve this kernel's arithmetic rate.
inline v8f fma8(v8f x, v8f w, v8f acc) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

inline float hsum8(v8f v) {
  const float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

inline v8f loadw8(const float* p) { return load8(p); }
inline v8f loadw8(const uint16_t* p) {  // 8 bf16 -> fp32
#if defined(__AVX2__)
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  v8f r;
  for (int i = 0; i < 8; ++i) r[i] = bf16_value(p[i]);
  return r;
#endif
}

// Two weight rows, not one: with one, MR <= 3 would leave too few independent accumulators to
// cover the FMA latency. The inputs are read from L1 (FMA memory operands).
template <int MR, class W>
inline void tile2(const float* x, int64_t xs, const W* wa, const W* wb, int64_t K, float* ya, float* yb,
                  int64_t ys) {
  v8f a[MR], b[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) a[m] = b[m] = v8f{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const v8f va = loadw8(wa + k), vb = loadw8(wb + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const v8f xm = load8(x + m * xs + k);
      a[m] = fma8(xm, va, a[m]);
      b[m] = fma8(xm, vb, b[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float sa = hsum8(a[m]), sb = hsum8(b[m]);
    for (int64_t j = k; j < K; ++j) {  // K not a multiple of 8 (tiny test models)
      sa += x[m * xs + j] * wvalue(wa[j]);
      sb += x[m * xs + j] * wvalue(wb[j]);
    }
    ya[m * ys] = sa;
    yb[m * ys] = sb;
  }
}

// NR weight rows as pairs of `tile2` (an odd last row paired with itself, computed twice).
template <int NR, int MR, class W>
inline void tile(const float* x, int64_t xs, const W* const* w, int64_t K, float* const* y, int64_t ys, int64_t) {
  for (int j = 0; j < NR; j += 2) {
    const int b = j + 1 < NR ? j + 1 : j;
    tile2<MR>(x, xs, w[j], w[b], K, y[j], y[b], ys);
  }
}
#endif

// `tile` for all M input rows (x [M, K] dense): balanced groups of at most kGroup rows (5 -> 5,
// 8 -> 4 + 4, 16 -> 5 + 5 + 6).
template <int NR, class W>
inline void dots(const float* x, int64_t M, const W* const* w, int64_t K, float* const* y, int64_t ys, int64_t next) {
  const int64_t groups = (M + kGroup - 1) / kGroup;
  for (int64_t g = 0, m0 = 0; g < groups; ++g) {
    const int64_t mr = (M - m0) / (groups - g);
    const float* xg = x + m0 * K;
    const int64_t pf = g == 0 ? next : 0;  // the first group prefetches the next tile's weight rows
    float* yg[NR];
    for (int j = 0; j < NR; ++j) yg[j] = y[j] + m0 * ys;
    switch (mr) {
      case 1: tile<NR, 1>(xg, K, w, K, yg, ys, pf); break;
      case 2: tile<NR, 2>(xg, K, w, K, yg, ys, pf); break;
      case 3: tile<NR, 3>(xg, K, w, K, yg, ys, pf); break;
      case 4: tile<NR, 4>(xg, K, w, K, yg, ys, pf); break;
      case 5: tile<NR, 5>(xg, K, w, K, yg, ys, pf); break;
      default: tile<NR, 6>(xg, K, w, K, yg, ys, pf); break;
    }
    m0 += mr;
  }
}

// y[m * N + r] = x_m . w_r for the M rows of x [M, K] and rows r in [r0, r1) of w [N, K]: four
// adjacent rows at a time, then the one to three left.
template <class W>
inline void rows_m(const float* x, int64_t M, const W* w, int64_t K, int64_t N, float* y, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const W* ws[4] = {w + r * K, w + (r + 1) * K, w + (r + 2) * K, w + (r + 3) * K};
    float* ys[4] = {y + r, y + r + 1, y + r + 2, y + r + 3};
    dots<4>(x, M, ws, K, ys, N, r + 8 <= r1 ? 4 * K : 0);
  }
  for (; r + 2 <= r1; r += 2) {
    const W* ws[2] = {w + r * K, w + (r + 1) * K};
    float* ys[2] = {y + r, y + r + 1};
    dots<2>(x, M, ws, K, ys, N, 0);
  }
  if (r < r1) {
    const W* ws[1] = {w + r * K};
    float* ys[1] = {y + r};
    dots<1>(x, M, ws, K, ys, N, 0);
  }
}

}  // namespace portside_tile
